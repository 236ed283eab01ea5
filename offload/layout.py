"""What a KV block is made of (model identity, dtype, shape) and a stable key for it."""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

FORMAT_VERSION = 1
_EDGE = 1 << 20  # bytes hashed from each end of a model file


def model_identity(path: str | os.PathLike[str], extra: str = "") -> str:
    """A cheap identity of a model file: sha256 of its size, first and last MiB (and `extra`, e.g. a dtype)."""
    p = Path(path)
    h = hashlib.sha256()
    if p.is_dir():  # a Hugging Face folder: every file's name, size and edges
        files = sorted(f for f in p.rglob("*") if f.is_file())
    else:
        files = [p]
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size};".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(_EDGE))
            if size > _EDGE:
                fh.seek(max(_EDGE, size - _EDGE))
                h.update(fh.read(_EDGE))
    h.update(extra.encode())
    return h.hexdigest()


@dataclass(frozen=True)
class KVLayout:
    """One block's K (and V) tensor: shape [num_layers, block_size, num_kv_heads, head_dim] in `dtype`. In a
    quantized KV format (`kv_format`, e.g. "q8_0"; "" for plain float values) `head_dim` is a head row's storage
    (q8_0: bytes) and the format enters the key. A hybrid's state snapshot format (`state_format`, its bytes
    `state_nbytes`) enters the key too."""

    model_id: str
    dtype: torch.dtype
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    kv_format: str = ""
    # a hybrid model's recurrent-state snapshots (engine.cache.state_pool.StateSpec.format and bytes_per_sequence): stored
    # beside the blocks, keyed like them; "" / 0 for a model without state layers
    state_format: str = ""
    state_nbytes: int = 0

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Shape of one block's K (V has the same)."""
        return (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def tensor_nbytes(self) -> int:
        """Bytes of one block's K (or V)."""
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block's K and V together."""
        return 2 * self.tensor_nbytes

    def describe(self) -> dict:
        """A JSON-able description (written next to the disk tier's block files)."""
        out = {"format": FORMAT_VERSION, "model_id": self.model_id, "dtype": str(self.dtype).removeprefix("torch."),
               "shape": list(self.shape)}
        if self.kv_format:  # plain float pools keep the keys their stored blocks were written under
            out["kv_format"] = self.kv_format
        if self.state_format:  # likewise: keys of models without state layers do not change
            out["state_format"] = self.state_format
            out["state_nbytes"] = self.state_nbytes
        return out

    @property
    def key(self) -> str:
        """A stable hex key of everything that must match for a stored block to be reused."""
        return hashlib.sha256(json.dumps(self.describe(), sort_keys=True).encode()).hexdigest()[:32]
