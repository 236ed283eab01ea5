"""Paged attention entry point in Triton with the torch reference's signature (twin: `paged_attention.paged_attention`).

A step whose sequences all have one query token (a decode step, the one CUDA graphs capture) runs the
flash-decoding kernel; any step with a longer query (prefill chunks, mixed batches) runs the ragged prefill
kernel over the whole batch, decode rows included.
"""

from __future__ import annotations

import torch

from edgeserve.kernels.torch.paged_attention import AttentionMetadata
from edgeserve.kernels.triton.decode_attention import paged_decode_attention
from edgeserve.kernels.triton.prefill_attention import paged_prefill_attention


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float | None = None, window: int | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q [T, H, D] over each sequence's paged K/V (`window`: the last `window` keys only;
    `sinks`: float32 [H] attention sinks); returns [T, H, D] in q's dtype."""
    if meta.max_query_len <= 1:
        return paged_decode_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                      meta.max_seq_len, scale, window=window, sinks=sinks)
    return paged_prefill_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                   meta.max_query_len, scale, window, sinks)
