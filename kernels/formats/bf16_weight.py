"""A 16-bit (F16 / BF16) weight matrix multiplied in bfloat16 by the native kernel (kernels/cpu/src/bf16_matmul.c) on
the native thread pool, on CPUs with AVX-512 BF16 dot products.

The weight is rounded to bfloat16 and packed once; each matmul rounds its float32 activations to bfloat16 (as
torch's `.to(torch.bfloat16)` does) and sums in float32, returning float32 with the bias added: the arithmetic of
torch's bfloat16 `F.linear` without its rounding of the output to bfloat16, and on the native pool's threads
beside the quantized matmuls instead of torch's OpenMP team.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from edgeserve.kernels.cpu.native import library, result_buffer


def bf16_library(lib: Any = None) -> ctypes.CDLL | None:
    """The native library when it has the bfloat16 kernel and this CPU runs it (AVX-512 BF16), else None."""
    lib = lib if lib is not None else library()
    if lib is None:
        return None
    return lib if lib.qmm_bf16_supported() else None


class Bf16Weight:
    """A linear weight [out, in] kept as packed bfloat16 panels; `matmul(x, bias)` gives float32 x @ W.T + bias."""

    def __init__(self, weight: torch.Tensor, lib: ctypes.CDLL | None = None):
        lib = bf16_library(lib)
        if lib is None:
            raise RuntimeError("the native bfloat16 matmul is not available on this CPU")
        if weight.dim() != 2:
            raise ValueError(f"a Bf16Weight is a matrix, not a tensor of shape {tuple(weight.shape)}")
        self.lib = lib
        self.out_features, self.in_features = (int(n) for n in weight.shape)
        w = weight.to(torch.bfloat16).contiguous()
        self.packed = torch.empty(lib.qmm_bf16_packed_size(self.out_features, self.in_features), dtype=torch.int16)
        lib.qmm_bf16_pack(w.data_ptr(), self.in_features, self.out_features, self.in_features, self.packed.data_ptr())

    @classmethod
    def stacked(cls, parts: list["Bf16Weight"]) -> "Bf16Weight":
        """One weight of `parts` stacked along the output rows (a fused q/k/v): their packed panels joined where each
        has a multiple of 32 rows (the packing's unit), else packed again from their values."""
        if len({p.in_features for p in parts}) != 1:
            raise ValueError(f"parts disagree on in_features: {sorted({p.in_features for p in parts})}")
        if any(p.out_features % 32 for p in parts):
            return cls(torch.cat([p.dequantize() for p in parts]), parts[0].lib)
        fused = cls.__new__(cls)
        fused.lib, fused.in_features = parts[0].lib, parts[0].in_features
        fused.out_features = sum(p.out_features for p in parts)
        fused.packed = torch.cat([p.packed for p in parts])
        return fused

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None
               ) -> torch.Tensor:
        """x [..., in] @ W.T (+ bias [out]) -> float32 [..., out], into `out` (a contiguous float32 buffer of at least
        that many values, e.g. an encoder's reused workspace) where given."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, the weight takes {self.in_features}")
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32 or x2.stride(-1) != 1:
            x2 = x2.float().contiguous()
        b = None if bias is None else bias.float().contiguous()
        m = x2.shape[0]
        out = result_buffer(out, m, self.out_features)
        rc = self.lib.qmm_bf16_matmul(x2.data_ptr(), x2.stride(0) if m else self.in_features, m, self.in_features,
                                      self.packed.data_ptr(), self.out_features,
                                      None if b is None else b.data_ptr(), out.data_ptr(), self.out_features)
        if rc == -2:
            raise MemoryError(f"the bfloat16 matmul of {m} rows could not allocate its scratch memory")
        if rc != 0:
            raise RuntimeError("the native bfloat16 matmul refused to run on this CPU")
        return out.reshape(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The weight in float32 as the kernel multiplies it (rounded to bfloat16), for tests and references."""
        eye = torch.eye(self.in_features)
        return self.matmul(eye).T.contiguous()
