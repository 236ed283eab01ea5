"""Paged attention for prefill in Triton: a flat ragged batch, each sequence's new query rows attending causally
to its cached prefix and its new tokens, K/V read through the block table.

One program per (sequence, query head, tile of BLOCK_M query rows). Sequence b's rows are
query_start_loc[b] .. query_start_loc[b+1]; its context is seq_lens[b] tokens and its row j sees keys
0 .. seq_lens[b] - q_len + j. Keys are gathered BLOCK_N tokens at a time (any cache block size) with an online
softmax; a tile stops at the last key its last row can see. Rows of one-token sequences (decodes in a mixed
batch) are handled the same way. An attention sink (a per-head logit with no value, gpt-oss) starts the online
softmax as a key of score `sink` and value 0.
"""

from __future__ import annotations

import torch

from edgeserve.kernels.triton.runtime import dot_dtype, dot_precision, next_pow2, tl, triton
from edgeserve.kernels.triton.paged_tiles import paged_inputs, tile_scores, tile_values, token_offsets

BLOCK_M = 16
BLOCK_N = 16


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, seq_lens_ptr, q_start_ptr, sinks_ptr, scale_log2,
                    block_size, window,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_tb,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
                    HAS_SINKS: tl.constexpr, FP8: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(q_start_ptr + b)
    q_len = tl.load(q_start_ptr + b + 1) - q_start
    if tile * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + b)
        past = seq_len - q_len
        hk = h // GROUP
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        r_mask = rows < q_len
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_DIM
        tok_rows = (q_start + rows).to(tl.int64)
        q = tl.load(q_ptr + tok_rows[:, None] * stride_qt + h * stride_qh + d[None, :],
                    mask=r_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        q = (q * scale_log2).to(DOT)
        limit = past + rows  # last key each row sees
        # sliding window (window > 0): row r sees keys limit - window + 1 .. limit; the tile starts at its first row's
        first = tl.where(window > 0, tl.maximum(past + tile * BLOCK_M - window + 1, 0), 0)
        lowest = tl.where(window > 0, limit - window + 1, 0)

        if HAS_SINKS:  # the sink as a first key: score sink (base 2), weight exp2(0) = 1, no value
            m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
            l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        end = tl.minimum(seq_len, past + tl.minimum((tile + 1) * BLOCK_M, q_len))
        for n0 in range(first, end, BLOCK_N):
            tok = n0 + tl.arange(0, BLOCK_N)
            off, t_mask, kv_mask = token_offsets(tables_ptr, b, tok, end, d_mask, hk, block_size, stride_tb,
                                                 stride_cb, stride_cs, stride_ch)
            s = tile_scores(q, k_ptr, off, t_mask, kv_mask, d, HEAD_DIM, DOT, PRECISION, FP8)  # [BLOCK_M, BLOCK_N]
            s = tl.where(t_mask[None, :] & (tok[None, :] <= limit[:, None]) & (tok[None, :] >= lowest[:, None]), s,
                         float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # a row whose window starts past this tile has seen nothing yet: keep it at zero, not NaN
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            acc = tile_values(acc, p, alpha, v_ptr, off, t_mask, kv_mask, d, HEAD_DIM, DOT, PRECISION, FP8)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok_rows[:, None] * stride_ot + h * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                            max_query_len: int, scale: float | None = None, window: int | None = None,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q [T, H, D] (a ragged batch) over each sequence's paged K/V; returns [T, H, D] in q's dtype.

    The K/V of this step's tokens must already be in the pool. `window`: each row sees only its last `window` keys.
    `sinks`: float32 [H] attention sinks, one logit per head added to its softmax's denominator.
    """
    q, dims = paged_inputs(q, k_cache, seq_lens)
    out = torch.empty_like(q)
    if dims.batch == 0 or dims.tokens == 0:
        return out
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV pool must be contiguous")
    scale = dims.head_dim ** -0.5 if scale is None else scale
    grid = (dims.batch, dims.heads, triton.cdiv(max_query_len, BLOCK_M))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        out if sinks is None else sinks.float().contiguous(), scale * 1.4426950408889634, dims.block_size,
        window or 0, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=dims.heads // dims.num_kv_heads, HEAD_DIM=dims.head_dim, BLOCK_D=max(16, next_pow2(dims.head_dim)),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DOT=dot_dtype(dims.kv_dtype), PRECISION=dot_precision(dims.kv_dtype),
        HAS_SINKS=sinks is not None, FP8=dims.fp8,
    )
    return out
