"""Loading a decoder's tensors from a weight source onto one device: float32 vectors, linear-weight matrices and
row-lookup tables (token embeddings), plus the embedding table with its (possibly tied) output head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from edgeserve.kernels.cpu.native import BlockWeight, block_weight
from edgeserve.kernels.dispatch import use_triton
from edgeserve.kernels.formats.quant_linear import Int8Weight, LinearWeight, int8_supported
from edgeserve.loaders.weights import WeightSource
from edgeserve.models.llama import load_matrix

Table = torch.Tensor | Int8Weight | BlockWeight


def load_table(source: WeightSource, name: str, dtype: torch.dtype, device: torch.device,
               int8: bool = True) -> Table:
    """A row-lookup table (token embeddings): GGUF blocks on the native CPU kernels, int8 rows on a bf16 CPU (where
    `int8`: a table that is also the output head, whose read int8 halves), else dense `dtype` (float32 stays exact).
    A table for lookups alone stays in `dtype`: per-row int8 rows cost Qwen3.5 most of its bf16 drift (issue 54)."""
    native = block_weight(source, [name], device, dtype) if not use_triton(device) else None
    if native is not None:
        return native
    value = source.get(name, keep_int4=False)
    assert isinstance(value, torch.Tensor)
    table = value.to(device=device, dtype=torch.float32)
    return Int8Weight(table, dtype) if int8 and int8_supported(device, dtype) else table.to(dtype)


def table_rows(table: Table, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a table as float32 [T, width]."""
    if not isinstance(table, torch.Tensor):
        return table.rows(ids)
    return F.embedding(ids, table).float()


@dataclass
class WeightLoader:
    """One model's tensors from `source` onto `device`, matrices in `dtype` (the form load_matrix picks)."""

    source: WeightSource
    dtype: torch.dtype
    device: torch.device
    keep_int4: bool = True
    dense_prefill: bool = False

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor `name` as float32 on the device, in its stored shape."""
        value = self.source.get(name, keep_int4=False)
        assert isinstance(value, torch.Tensor)
        return value.to(device=self.device, dtype=torch.float32)

    def vector(self, name: str) -> torch.Tensor:
        """Tensor `name` as a flat float32 vector on the device."""
        return self.tensor(name).reshape(-1)

    def matrix(self, names: list[str]) -> LinearWeight:
        """The matrices `names` stacked by output rows into one linear weight."""
        return load_matrix(self.source, names, self.dtype, self.device, self.keep_int4, self.dense_prefill)

    def embed_and_head(self, embed_name: str, tie: bool) -> tuple[Table, LinearWeight]:
        """(the token-embedding table `embed_name`, the output head): `lm_head.weight` where the source has it and
        the embeddings are not tied, else the embedding table itself."""
        untied = not tie and self.source.has("lm_head.weight")
        embed = load_table(self.source, embed_name, self.dtype, self.device, int8=not untied)
        lm_head: LinearWeight = embed  # type: ignore[assignment]
        if untied:
            lm_head = self.matrix(["lm_head.weight"])
        return embed, lm_head
