"""Bidirectional attention of an encoder's padded batch on the native pool (kernels/cpu/src/encoder_attention.c): the
native twin of `F.scaled_dot_product_attention` under a right-padding key mask, for encoders whose matmuls already
run on the native pool (torch's own ops there run on one thread, so its attention would too): text encoders and the
vision towers (edgeserve/vision/vit.py; the keys are walked in blocks, so thousands of patches stay in cache)."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from edgeserve.kernels.cpu.native import library



def head_dim_supported(head_dim: int) -> bool:
    """Whether the kernel takes this head size: a multiple of 8 up to 128 (MiniLM, bge-small: 32; BERT-base,
    SigLIP base: 64; SigLIP so400m: 72)."""
    return head_dim % 8 == 0 and 8 <= head_dim <= 128


def attention_library(head_dim: int, lib: Any = None) -> ctypes.CDLL | None:
    """The native library when its build runs the encoder attention kernel for `head_dim` (AVX-512 builds), else
    None."""
    lib = lib if lib is not None else library()
    if lib is None or not head_dim_supported(head_dim):
        return None
    return lib if lib.qmm_encoder_attention_available() else None


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, heads: int,
                      lib: ctypes.CDLL, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """Attention of q, k, v [B, T, heads * D] (float32) where sequence b's queries see its first lengths[b] keys;
    [B, T, heads * D] float32 out (rows past a sequence's length attend like the others; their values are unused),
    written into `out` where given (a float32 [B, T, heads * D] tensor or view of a wider one, e.g. some heads' columns
    of a reused buffer). None where the kernel does not take these inputs (the caller runs torch's attention)."""
    b, t, width = q.shape
    d = width // heads
    if out is None:
        out = torch.empty(b, t, width, dtype=torch.float32)
    if (q.dtype != torch.float32 or k.dtype != torch.float32 or v.dtype != torch.float32 or not head_dim_supported(d)
            or out.dtype != torch.float32 or out.shape != q.shape
            or any(x.stride(-1) != 1 or (b > 1 and x.stride(0) != t * x.stride(1)) for x in (q, k, v, out))):
        return None
    lens = lengths.to(torch.int32).contiguous()
    rc = lib.qmm_encoder_attention(q.data_ptr(), q.stride(1), k.data_ptr(), k.stride(1), v.data_ptr(), v.stride(1),
                                   b, t, heads, d, lens.data_ptr(), d ** -0.5, out.data_ptr(), out.stride(1))
    if rc == -2:
        raise ValueError(f"sequence lengths {lens.tolist()} must be within 1 .. {t}")
    return out if rc == 0 else None
