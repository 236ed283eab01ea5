"""The quantized KV cache formats in torch: q8_0 (the reference the native kernels, kernels/cpu/include/kv_q8.h, are held
to) and fp8 (the reference the Triton kernels are held to); the twins the torch paths use.

A pool in q8_0 is uint8 [..., D / 32 * 34]: each head row of D values (D a multiple of 32) is D / 32 blocks laid
out as GGUF's block_q8_0, a float16 scale d then 32 int8 values q (value = d * q). Quantized as ggml's reference
does: d = max |x| / 127 in float32, q = round(x / d) half away from zero, d stored as float16.

A pool in fp8 is float8_e4m3fn [..., D + 4]: each head row of D values is D e4m3 values then its float32 scale's 4
bytes (little-endian; value = scale * e4m3). One scale per (token, KV head) row, computed where the row is written:
scale = max |x| / 448 in float32, e4m3 = x * (1 / scale) rounded to nearest even. A row scale needs no calibration
(GGUF carries no KV scales) and no state carried across requests, so what a token stores depends on that token
alone; a per-tensor scale (vLLM's default, 1.0 uncalibrated) would clip the K outliers some models have.
"""

from __future__ import annotations

import torch

Q8_BLOCK = 32
Q8_BYTES = 34
FP8_MAX = 448.0  # the largest finite e4m3fn value
FP8_SCALE_WIDTH = 4  # float8 elements (bytes) a row's float32 scale takes


def q8_row_bytes(head_dim: int) -> int:
    """Bytes of one q8_0 head row of `head_dim` values; ValueError when head_dim is not a multiple of 32."""
    if head_dim % Q8_BLOCK:
        raise ValueError(f"a q8_0 KV cache needs a head size that is a multiple of {Q8_BLOCK}, not {head_dim}")
    return head_dim // Q8_BLOCK * Q8_BYTES


def fp8_row_width(head_dim: int) -> int:
    """Elements (bytes) of one fp8 head row of `head_dim` values, its scale included; ValueError when head_dim is not
    a multiple of 4 (the scale must stay 4-byte aligned)."""
    if head_dim % FP8_SCALE_WIDTH:
        raise ValueError(f"an fp8 KV cache needs a head size that is a multiple of {FP8_SCALE_WIDTH}, not {head_dim}")
    return head_dim + FP8_SCALE_WIDTH


def is_q8(cache: torch.Tensor) -> bool:
    """Whether a pool tensor holds q8_0 rows (a uint8 pool is always q8_0)."""
    return cache.dtype == torch.uint8


def is_fp8(cache: torch.Tensor) -> bool:
    """Whether a pool tensor holds fp8 rows with scales (a float8_e4m3fn pool is always this format)."""
    return cache.dtype == torch.float8_e4m3fn


def is_quantized(cache: torch.Tensor) -> bool:
    """Whether a pool tensor holds quantized rows (q8_0 or fp8) rather than plain float values."""
    return is_q8(cache) or is_fp8(cache)


def quantize_kv(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """x [..., D] in the storage of the pool `cache` (quantized rows, or x cast to a float pool's dtype)."""
    if is_q8(cache):
        return quantize_q8(x)
    if is_fp8(cache):
        return quantize_fp8(x)
    return x.to(cache.dtype)


def dequantize_kv(cache: torch.Tensor) -> torch.Tensor:
    """A quantized pool's values as float32 [..., D]; a float pool as it is."""
    if is_q8(cache):
        return dequantize_q8(cache)
    if is_fp8(cache):
        return dequantize_fp8(cache)
    return cache


def quantize_fp8(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype) as fp8 rows with their scales, float8_e4m3fn [..., D + 4]."""
    *lead, d = x.shape
    fp8_row_width(d)
    rows = x.float()
    scale = rows.abs().amax(dim=-1, keepdim=True) / FP8_MAX
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = (rows * inv).to(torch.float8_e4m3fn)
    return torch.cat([q, scale.contiguous().view(torch.float8_e4m3fn)], dim=-1)


def dequantize_fp8(rows: torch.Tensor) -> torch.Tensor:
    """fp8 rows float8_e4m3fn [..., D + 4] as float32 [..., D]."""
    d = rows.shape[-1] - FP8_SCALE_WIDTH
    scale = rows[..., d:].contiguous().view(torch.float32)
    return rows[..., :d].float() * scale


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
