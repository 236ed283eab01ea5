"""Pre-quantized 4-bit safetensors checkpoints (AWQ GEMM and GPTQ) read as Q4Blocks.

Both store, per linear layer `X`, `X.qweight` (int32, eight 4-bit values per word, bits 4i..4i+3 hold value i),
`X.qzeros` (int32, the integer zero points packed the same way along the output dimension) and `X.scales`
(fp16 [in // group, out]); the weight is w[o, i] = (q[o, i] - zero[i // group, o]) * scale[i // group, o].

- AWQ (GEMM version): qweight is [in, out // 8], packed along the output dimension in AWQ's interleaved order:
  value i of word j is output column 8j + [0, 2, 4, 6, 1, 3, 5, 7][i]; qzeros uses the same order.
- GPTQ: qweight is [in // 8, out], packed along the input dimension in plain order (value i of word j is input
  row 8j + i); qzeros [in // group, out // 8] in plain order. The original ("v1", `checkpoint_format` "gptq")
  format stores zero - 1, so the zero point is the stored value + 1 (what its kernels compute, 16 included);
  "gptq_v2" stores the zero itself. `g_idx` [in] gives each input row's group: only the plain i // group
  layout is supported (act-order checkpoints that reorder groups are refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from edgeserve.errors import UnsupportedModelError
from edgeserve.kernels.formats.quant_linear import Q4Blocks

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # value i of a word -> column 8j + AWQ_ORDER[i]
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@dataclass(frozen=True)
class PrequantizedFormat:
    """What a checkpoint's `quantization_config` says about its 4-bit layers."""

    method: str  # "awq" or "gptq"
    group_size: int  # -1: one group per row
    zero_plus_one: bool = False  # GPTQ v1: stored zeros are zero - 1

    def blocks(self, tensor: Callable[[str], torch.Tensor | None], name: str) -> Q4Blocks:
        """The Q4Blocks of layer `name`; `tensor(suffix)` reads `<name>.<suffix>` ("qweight", ...), None if absent."""
        parts = {k: tensor(k) for k in ("qweight", "qzeros", "scales")}
        missing = [k for k, v in parts.items() if v is None]
        if missing:
            raise UnsupportedModelError(f"{name}: {self.method.upper()} layer without {', '.join(missing)}")
        qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"].float()  # type: ignore[union-attr]
        groups, out_f = scales.shape
        if self.method == "awq":
            q = unpack_awq(qweight)  # [in, out]
            zeros = unpack_awq(qzeros).float()
        else:
            q = unpack_rows(qweight)  # [in, out]
            zeros = unpack_cols(qzeros).float() + (1 if self.zero_plus_one else 0)
        in_f = q.shape[0]
        if q.shape[1] != out_f or zeros.shape != scales.shape or in_f % groups:
            raise UnsupportedModelError(
                f"{name}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and scales "
                f"{tuple(scales.shape)} do not fit a {self.method.upper()} 4-bit layer")
        g = in_f // groups
        if self.method == "gptq":
            g_idx = tensor("g_idx")
            if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(in_f) // g):
                raise UnsupportedModelError(
                    f"{name}: GPTQ act-order (desc_act) checkpoints, whose g_idx reorders the groups, are not "
                    "supported; use one quantized with desc_act=false")
        scale = scales.t().contiguous()
        return Q4Blocks(q.t().contiguous(), scale, -(zeros.t() * scale), g)


def unpack_cols(packed: torch.Tensor) -> torch.Tensor:
    """int32 [r, c] -> uint8 [r, 8c]: value i of word j becomes column 8j + i."""
    r, c = packed.shape
    return ((packed.to(torch.int32).unsqueeze(-1) >> _SHIFTS) & 0xF).reshape(r, 8 * c).to(torch.uint8)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [r, c] -> uint8 [8r, c]: value i of word (j, col) becomes row 8j + i."""
    r, c = packed.shape
    return ((packed.to(torch.int32).unsqueeze(1) >> _SHIFTS[:, None]) & 0xF).reshape(8 * r, c).to(torch.uint8)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ int32 [r, c] -> uint8 [r, 8c] in natural column order."""
    q = unpack_cols(packed)
    r, n = q.shape
    order = torch.tensor(AWQ_ORDER)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(8)  # column 8j + k sits at value inverse[k] of word j
    index = (torch.arange(n // 8)[:, None] * 8 + inverse[None, :]).reshape(-1)
    return q[:, index]


def prequantized_format(config: dict[str, Any]) -> PrequantizedFormat | None:
    """The format of a checkpoint from config.json's `quantization_config`; None for a float checkpoint."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "mxfp4" and config.get("model_type") == "gpt_oss":
        return None  # only the experts are MXFP4, and edgeserve.models.archs.gpt_oss reads them
    if method not in ("awq", "gptq"):
        raise UnsupportedModelError(
            f"quantization method {method or 'unknown'!r} is not supported (supported: 4-bit awq and gptq)")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise UnsupportedModelError(f"{method.upper()} with {bits} bits is not supported (only 4-bit)")
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise UnsupportedModelError(f"AWQ version {version!r} is not supported (only 'gemm')")
        if not qc.get("zero_point", True):
            raise UnsupportedModelError("AWQ without zero points (zero_point: false) is not supported")
        return PrequantizedFormat("awq", group)
    fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise UnsupportedModelError(f"GPTQ checkpoint format {fmt!r} is not supported (gptq, gptq_v2)")
    return PrequantizedFormat("gptq", group, zero_plus_one=fmt == "gptq")
