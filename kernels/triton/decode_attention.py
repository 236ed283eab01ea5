"""Paged attention for decode in Triton: flash-decoding (split over the KV sequence, then a reduce), GQA-aware.

Stage 1, one program per (sequence, KV head, split): the query heads that share the KV head are loaded
together as one [GROUP, D] tile, so every K/V byte of the split is read once for the whole group; tokens are
gathered through the block table BLOCK_N at a time (any cache block size), with an online softmax. Each split
writes its normalized partial output and its log-sum-exp (base 2). Stage 2, one program per (sequence, query
head), weights the splits by their log-sum-exp; attention sinks (a per-head logit with no value, gpt-oss) join
there as one more term of the denominator.
"""

from __future__ import annotations

import torch

from edgeserve.kernels.triton.paged_tiles import paged_inputs, tile_scores, tile_values, token_offsets
from edgeserve.kernels.triton.runtime import dot_dtype, dot_precision, next_pow2, tl, triton

BLOCK_N = 16  # tokens per inner step (tl.dot needs >= 16 on the GPU)
TARGET_PROGRAMS = 256  # stage-1 programs to aim for when choosing the split count


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, q_start_ptr, part_o_ptr, part_lse_ptr,
                         scale_log2, block_size, window,
                         stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_tb,
                         stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                         tokens_per_split,
                         GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_N: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
                         FP8: tl.constexpr):
    b = tl.program_id(0)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    row = tl.load(q_start_ptr + b).to(tl.int64)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    # sliding window: only the last `window` keys; a split wholly before them stays empty
    start = tl.where(window > 0, tl.maximum(start, seq_len - window), start)

    g = tl.arange(0, BLOCK_G)
    heads = hk * GROUP + g
    g_mask = g < GROUP
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    q = (q * scale_log2).to(DOT)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        off, t_mask, kv_mask = token_offsets(tables_ptr, b, tok, end, d_mask, hk, block_size, stride_tb, stride_cb,
                                             stride_cs, stride_ch)
        s = tile_scores(q, k_ptr, off, t_mask, kv_mask, d, HEAD_DIM, DOT, PRECISION, FP8)  # [BLOCK_G, BLOCK_N]
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        acc = tile_values(acc, p, alpha, v_ptr, off, t_mask, kv_mask, d, HEAD_DIM, DOT, PRECISION, FP8)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    has = l_i > 0  # an empty split (past the sequence's end) stores lse = -inf and is ignored by the reduce
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(part_o_ptr + b.to(tl.int64) * stride_pb + heads[:, None] * stride_ph + split * stride_ps + d[None, :],
             out, mask=g_mask[:, None] & d_mask[None, :])
    tl.store(part_lse_ptr + b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(part_o_ptr, part_lse_ptr, out_ptr, seq_lens_ptr, q_start_ptr, sinks_ptr, tokens_per_split,
                          stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ot, stride_oh,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                          HAS_SINKS: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    row = tl.load(q_start_ptr + b).to(tl.int64)
    n_splits = tl.cdiv(seq_len, tokens_per_split)
    s = tl.arange(0, BLOCK_S)
    s_mask = s < n_splits
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    lse = tl.load(part_lse_ptr + b.to(tl.int64) * stride_lb + h * stride_lh + s, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634  # base 2, as the lse
        top = tl.where(seq_len > 0, tl.maximum(top, sink), top)
    top = tl.where(top == float("-inf"), 0.0, top)  # a padding sequence (seq_len 0) has no split at all
    w = tl.where(s_mask, tl.exp2(lse - top), 0.0)
    total = tl.sum(w, axis=0)
    if HAS_SINKS:
        total += tl.where(seq_len > 0, tl.exp2(sink - top), 0.0)
    w = w / tl.where(total > 0, total, 1.0)
    o = tl.load(part_o_ptr + b.to(tl.int64) * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(o * w[:, None], axis=0)
    tl.store(out_ptr + row * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def choose_tokens_per_split(batch: int, num_kv_heads: int, max_seq_len: int) -> int:
    """KV tokens per split: enough splits to fill the device, each a multiple of BLOCK_N."""
    max_splits = max(1, triton.cdiv(max_seq_len, BLOCK_N))
    splits = min(max_splits, max(1, triton.cdiv(TARGET_PROGRAMS, batch * num_kv_heads)))
    return triton.cdiv(triton.cdiv(max(max_seq_len, 1), splits), BLOCK_N) * BLOCK_N


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                           max_seq_len: int, scale: float | None = None, out: torch.Tensor | None = None,
                           tokens_per_split: int | None = None, window: int | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query row per sequence (row query_start_loc[b]) over its seq_lens[b] paged tokens.

    q [T, H, D]; returns (or fills) out [T, H, D] in q's dtype, writing only the rows named by query_start_loc[:-1].
    `max_seq_len` bounds seq_lens and fixes the split layout (pass the same value for every CUDA-graph replay).
    A padding sequence (seq_len 0, as in a batch padded up to a captured size) gets an all-zero output row.
    `window`: a sliding-window layer, attending to the last `window` tokens only.
    `sinks`: float32 [H] attention sinks, one logit per head added to its softmax's denominator.
    """
    q, dims = paged_inputs(q, k_cache, seq_lens)
    if out is None:
        out = torch.empty_like(q)
    if dims.batch == 0:
        return out
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV pool must be contiguous")
    group = dims.heads // dims.num_kv_heads
    scale = dims.head_dim ** -0.5 if scale is None else scale
    per_split = tokens_per_split or choose_tokens_per_split(dims.batch, dims.num_kv_heads, max_seq_len)
    n_splits = max(1, triton.cdiv(max_seq_len, per_split))
    part_o = torch.empty(dims.batch, dims.heads, n_splits, dims.head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(dims.batch, dims.heads, n_splits, dtype=torch.float32, device=q.device)
    block_d = max(16, next_pow2(dims.head_dim))
    _decode_split_kernel[(dims.batch, dims.num_kv_heads, n_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, part_o, part_lse,
        scale * 1.4426950408889634, dims.block_size, window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        per_split,
        GROUP=group, BLOCK_G=max(16, next_pow2(group)), HEAD_DIM=dims.head_dim, BLOCK_D=block_d, BLOCK_N=BLOCK_N,
        DOT=dot_dtype(dims.kv_dtype), PRECISION=dot_precision(dims.kv_dtype), FP8=dims.fp8,
    )
    _decode_reduce_kernel[(dims.batch, dims.heads)](
        part_o, part_lse, out, seq_lens, query_start_loc, part_lse if sinks is None else sinks.float().contiguous(),
        per_split,
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=dims.head_dim, BLOCK_D=block_d, BLOCK_S=next_pow2(n_splits), HAS_SINKS=sinks is not None,
    )
    return out
