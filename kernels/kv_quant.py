"""The q8_0 KV cache format in torch: the reference the native kernels (kernels/cpu/kv_q8.h) are held to, and the
twin the torch paths use.

A pool in q8_0 is uint8 [..., D / 32 * 34]: each head row of D values (D a multiple of 32) is D / 32 blocks laid
out as GGUF's block_q8_0, a float16 scale d then 32 int8 values q (value = d * q). Quantized as ggml's reference
does: d = max |x| / 127 in float32, q = round(x / d) half away from zero, d stored as float16.
"""

from __future__ import annotations

import torch

Q8_BLOCK = 32
Q8_BYTES = 34


def q8_row_bytes(head_dim: int) -> int:
    """Bytes of one q8_0 head row of `head_dim` values; ValueError when head_dim is not a multiple of 32."""
    if head_dim % Q8_BLOCK:
        raise ValueError(f"a q8_0 KV cache needs a head size that is a multiple of {Q8_BLOCK}, not {head_dim}")
    return head_dim // Q8_BLOCK * Q8_BYTES


def is_q8(cache: torch.Tensor) -> bool:
    """Whether a pool tensor holds q8_0 rows (a uint8 pool is always q8_0)."""
    return cache.dtype == torch.uint8


def quantize_q8(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype) as q8_0 rows, uint8 [..., D / 32 * 34]."""
    *lead, d = x.shape
    q8_row_bytes(d)
    blocks = x.float().reshape(-1, d // Q8_BLOCK, Q8_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = amax / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    v = blocks * inv
    r = torch.trunc(v)
    q = (r + torch.where((v - r).abs() >= 0.5, torch.sign(v), torch.zeros_like(v))).to(torch.int8)  # roundf
    half = scale.to(torch.float16).view(torch.uint8)  # [n, blocks, 2] little-endian bytes
    out = torch.cat([half.reshape(*half.shape[:-1], 2), q.view(torch.uint8)], dim=-1)
    return out.reshape(*lead, d // Q8_BLOCK * Q8_BYTES)


def dequantize_q8(rows: torch.Tensor) -> torch.Tensor:
    """q8_0 rows uint8 [..., D / 32 * 34] as float32 [..., D]."""
    *lead, nbytes = rows.shape
    blocks = rows.reshape(-1, nbytes // Q8_BYTES, Q8_BYTES)
    scale = blocks[..., :2].contiguous().view(torch.float16).float()
    q = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (q * scale).reshape(*lead, nbytes // Q8_BYTES * Q8_BLOCK)
