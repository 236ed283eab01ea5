"""Triton pieces the paged attention kernels (decode_attention, prefill_attention) share: gathering a tile of
tokens through the block table, their scores against the query tile, and the online-softmax update of the
accumulator by their values (fp8 rows weighed by their scales, kernels.formats.kv_quant); and, on the host, the
shapes both launchers read off their inputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgeserve.kernels.formats.kv_quant import is_fp8
from edgeserve.kernels.triton.runtime import tl, triton


@dataclass(frozen=True)
class PagedShapes:
    """What a paged attention launch reads off q [T, H, D] and the KV pool [blocks, block_size, KV heads, row]."""
    block_size: int
    num_kv_heads: int
    tokens: int
    heads: int
    head_dim: int
    batch: int  # sequences (seq_lens' length)
    fp8: bool  # e4m3 rows with a float32 scale after each (kernels.formats.kv_quant)
    kv_dtype: torch.dtype  # what K/V are computed in


def paged_inputs(q: torch.Tensor, k_cache: torch.Tensor,
                 seq_lens: torch.Tensor) -> tuple[torch.Tensor, PagedShapes]:
    """(q with a unit stride in its last dim, the launch's PagedShapes)."""
    _, bs, nkv, _ = k_cache.shape
    t, nh, d = q.shape
    fp8 = is_fp8(k_cache)
    if q.stride(-1) != 1:
        q = q.contiguous()
    return q, PagedShapes(bs, nkv, t, nh, d, seq_lens.shape[0], fp8, q.dtype if fp8 else k_cache.dtype)


@triton.jit
def row_scales(cache_ptr, off, mask, HEAD_DIM: tl.constexpr):
    """The float32 scales of the fp8 rows at `off` (kernels.formats.kv_quant: 4 bytes after each row's values); 0 masked."""
    return tl.load((cache_ptr + off + HEAD_DIM).to(tl.pointer_type(tl.float32), bitcast=True), mask=mask, other=0.0)


@triton.jit
def token_offsets(tables_ptr, b, tok, end, d_mask, hk, block_size, stride_tb, stride_cb, stride_cs, stride_ch):
    """(offsets in the cache of KV head hk's rows of tokens `tok` of sequence b, the tokens before `end`, that mask
    by the head's columns `d_mask`)."""
    t_mask = tok < end
    block = tl.load(tables_ptr + b.to(tl.int64) * stride_tb + tok // block_size, mask=t_mask, other=0)
    off = block.to(tl.int64) * stride_cb + (tok % block_size) * stride_cs + hk * stride_ch
    return off, t_mask, t_mask[:, None] & d_mask[None, :]


@triton.jit
def tile_scores(q, k_ptr, off, t_mask, kv_mask, d, HEAD_DIM: tl.constexpr, DOT: tl.constexpr,
                PRECISION: tl.constexpr, FP8: tl.constexpr):
    """The (base-2) logits [rows of q, tokens] of the query tile q (already scaled) against the keys at `off`."""
    k = tl.load(k_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    s = tl.dot(q, tl.trans(k.to(DOT)), input_precision=PRECISION)
    if FP8:
        s = s * row_scales(k_ptr, off, t_mask, HEAD_DIM)[None, :]
    return s


@triton.jit
def tile_values(acc, p, alpha, v_ptr, off, t_mask, kv_mask, d, HEAD_DIM: tl.constexpr, DOT: tl.constexpr,
                PRECISION: tl.constexpr, FP8: tl.constexpr):
    """The accumulator rescaled by `alpha` plus the probabilities p times the values at `off` (fp8: the V row
    scales weigh the probabilities, sum_j p_j s_j v_j)."""
    v = tl.load(v_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    pv = p
    if FP8:
        pv = p * row_scales(v_ptr, off, t_mask, HEAD_DIM)[None, :]
    return acc * alpha[:, None] + tl.dot(pv.to(DOT), v.to(DOT), input_precision=PRECISION)
