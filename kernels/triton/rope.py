"""RoPE (rotate-half) fused with the K/V write into the paged cache, in Triton (twin: `rope.rope_write_kv`).

One program per (token, head) of q and k together: a q head is rotated into the output, a k head is rotated
and stored at the token's slot together with the matching v head. A negative slot (a padding token) writes
nothing to the cache. An fp8 pool (kernels.formats.kv_quant) gets each k and v head row as e4m3 values scaled by
max |row| / 448, the float32 scale in the 4 bytes after the row.
"""

from __future__ import annotations

import torch

from edgeserve.kernels.triton.runtime import next_pow2, tl, triton
from edgeserve.kernels.formats.kv_quant import is_fp8
from edgeserve.kernels.torch.rope import q_dtype


@triton.jit
def _round_e4m3(x):
    """x (float32, |x| <= 448) rounded to the nearest e4m3 value, ties to even, still float32: the cast that follows
    is then exact. Done by hand because Triton's interpreter drops the carry when rounding up crosses a power of two
    (31.5 -> 16); the GPU's conversion agrees with this either way."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000  # keep 3 mantissa bits, round to nearest even
    normal = bits.to(tl.float32, bitcast=True)
    tiny = ((x * 512.0 + 12582912.0) - 12582912.0) * 0.001953125  # subnormals: multiples of 2**-9 (1.5 * 2**23 trick)
    return tl.where(tl.abs(x) >= 0.015625, normal, tiny)


@triton.jit
def _store_row(dst, x1, x2, d, mask, HALF: tl.constexpr, FP8: tl.constexpr):
    """Store one head row given as its two float32 halves: cast to the pool's dtype, or as e4m3 with its scale."""
    if FP8:
        amax = tl.maximum(tl.max(tl.where(mask, tl.abs(x1), 0.0), axis=0),
                          tl.max(tl.where(mask, tl.abs(x2), 0.0), axis=0))
        scale = amax / 448.0  # kv_quant.FP8_MAX, the largest finite e4m3fn value
        inv = tl.where(scale > 0, 1.0 / scale, 0.0)
        x1 = _round_e4m3(x1 * inv)
        x2 = _round_e4m3(x2 * inv)
        tl.store((dst + 2 * HALF).to(tl.pointer_type(tl.float32), bitcast=True), scale)
    tl.store(dst + d, x1.to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + HALF + d, x2.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rope_write_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_ct, stride_st, stride_ot, stride_oh, stride_cache_slot, stride_cache_h,
                          NUM_Q_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                          FP8: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_HALF)
    mask = d < HALF
    c = tl.load(cos_ptr + t * stride_ct + d, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_st + d, mask=mask, other=0.0).to(tl.float32)
    if h < NUM_Q_HEADS:
        src = q_ptr + t * stride_qt + h * stride_qh
        x1 = tl.load(src + d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + d, mask=mask, other=0.0).to(tl.float32)
        dst = q_out_ptr + t * stride_ot + h * stride_oh
        tl.store(dst + d, (x1 * c - x2 * s).to(q_out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF + d, (x2 * c + x1 * s).to(q_out_ptr.dtype.element_ty), mask=mask)
    else:
        hk = h - NUM_Q_HEADS
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            src = k_ptr + t * stride_kt + hk * stride_kh
            x1 = tl.load(src + d, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(src + HALF + d, mask=mask, other=0.0).to(tl.float32)
            dst = k_cache_ptr + slot * stride_cache_slot + hk * stride_cache_h
            _store_row(dst, x1 * c - x2 * s, x2 * c + x1 * s, d, mask, HALF, FP8)
            vsrc = v_ptr + t * stride_vt + hk * stride_vh
            vdst = v_cache_ptr + slot * stride_cache_slot + hk * stride_cache_h
            v1 = tl.load(vsrc + d, mask=mask, other=0.0).to(tl.float32)
            v2 = tl.load(vsrc + HALF + d, mask=mask, other=0.0).to(tl.float32)
            _store_row(vdst, v1, v2, d, mask, HALF, FP8)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Rotate q [T, H, D] and k [T, Hkv, D] by per-token cos/sin [T, D // 2], store the rotated k and v [T, Hkv, D]
    at their slots of one layer's pool (as fp8 rows with scales for an fp8 pool), and return the rotated q in
    `rope.q_dtype` (rotation in float32)."""
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    cos, sin = _last_dim_contiguous(cos), _last_dim_contiguous(sin)
    t, nh, d = q.shape
    nkv = k.shape[1]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV pool must be contiguous")
    q_out = torch.empty(q.shape, dtype=q_dtype(q, k_cache), device=q.device)
    if t:
        head_stride = k_cache.shape[-1]  # d, or d + 4 for an fp8 row with its scale
        slot_stride = nkv * head_stride
        _rope_write_kv_kernel[(t, nh + nkv)](
            q, k, v, cos, sin, q_out, k_cache, v_cache, slot_mapping,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos.stride(0), sin.stride(0), q_out.stride(0), q_out.stride(1), slot_stride, head_stride,
            NUM_Q_HEADS=nh, HALF=d // 2, BLOCK_HALF=next_pow2(d // 2), FP8=is_fp8(k_cache),
        )
    return q_out
