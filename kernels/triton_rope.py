"""RoPE (rotate-half) fused with the K/V write into the paged cache, in Triton (twin: `rope.rope_write_kv`).

One program per (token, head) of q and k together: a q head is rotated into the output, a k head is rotated
and stored at the token's slot together with the matching v head. A negative slot (a padding token) writes
nothing to the cache.
"""

from __future__ import annotations

import torch

from ._triton import next_pow2, tl, triton


@triton.jit
def _rope_write_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_ct, stride_st, stride_ot, stride_oh, stride_cache_slot, stride_cache_h,
                          NUM_Q_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
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
            tl.store(dst + d, (x1 * c - x2 * s).to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(dst + HALF + d, (x2 * c + x1 * s).to(k_cache_ptr.dtype.element_ty), mask=mask)
            vsrc = v_ptr + t * stride_vt + hk * stride_vh
            vdst = v_cache_ptr + slot * stride_cache_slot + hk * stride_cache_h
            v1 = tl.load(vsrc + d, mask=mask, other=0.0)
            v2 = tl.load(vsrc + HALF + d, mask=mask, other=0.0)
            tl.store(vdst + d, v1.to(tl.float32).to(v_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(vdst + HALF + d, v2.to(tl.float32).to(v_cache_ptr.dtype.element_ty), mask=mask)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Rotate q [T, H, D] and k [T, Hkv, D] by per-token cos/sin [T, D // 2], store the rotated k and v [T, Hkv, D]
    at their slots of one layer's pool, and return the rotated q in the cache's dtype (rotation in float32)."""
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    cos, sin = _last_dim_contiguous(cos), _last_dim_contiguous(sin)
    t, nh, d = q.shape
    nkv = k.shape[1]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV pool must be contiguous")
    q_out = torch.empty(q.shape, dtype=k_cache.dtype, device=q.device)
    if t:
        slot_stride, head_stride = nkv * d, d
        _rope_write_kv_kernel[(t, nh + nkv)](
            q, k, v, cos, sin, q_out, k_cache, v_cache, slot_mapping,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos.stride(0), sin.stride(0), q_out.stride(0), q_out.stride(1), slot_stride, head_stride,
            NUM_Q_HEADS=nh, HALF=d // 2, BLOCK_HALF=next_pow2(d // 2),
        )
    return q_out
