"""An encoder's feed-forward bias + GELU (erf form, or the tanh form of SigLIP's towers) in one native pass, in place
(kernels/cpu/src/encoder_gelu.c; AVX-512 builds): torch's `F.gelu(y + b)` (`approximate="tanh"`) within 1e-6, without
its two passes and the sum's allocation."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from edgeserve.kernels.cpu.native import library


def gelu_library(lib: Any = None) -> ctypes.CDLL | None:
    """The native library when its build runs the bias + GELU kernel (AVX-512 builds), else None."""
    lib = lib if lib is not None else library()
    if lib is None:
        return None
    return lib if lib.qmm_bias_gelu(None, 0, 0, 0, None) == 0 else None  # the other builds refuse


def bias_gelu_(y: torch.Tensor, bias: torch.Tensor | None, lib: ctypes.CDLL, tanh: bool = False) -> bool:
    """y <- gelu(y + bias) in place (`tanh`: its tanh approximation) for a contiguous float32 y [..., n] and float32
    bias [n]; False (y untouched) where the inputs are not ones the kernel takes."""
    n = y.shape[-1]
    if (y.dtype != torch.float32 or not y.is_contiguous() or n == 0
            or (bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()))):
        return False
    rows = y.numel() // n
    fn = lib.qmm_bias_gelu_tanh if tanh else lib.qmm_bias_gelu
    return fn(y.data_ptr(), n, rows, n, None if bias is None else bias.data_ptr()) == 0
