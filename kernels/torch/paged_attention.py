"""Paged attention over a block-table KV pool: the torch reference (the Triton twins share these signatures).

The pool of one layer is `k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]`; slot s is
block s // block_size, offset s % block_size. A step is a flat ragged batch: sequence i owns query rows
query_start_loc[i]:query_start_loc[i+1], which are its last tokens, so its context is seq_lens[i] tokens
and query row j of it sees keys 0 .. seq_lens[i] - q_len + j.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from edgeserve.kernels.formats.kv_quant import dequantize_kv, is_quantized, quantize_kv
from edgeserve.kernels.transfer import to_device


@dataclass
class AttentionMetadata:
    """Where one step's tokens sit in the batch and in the KV pool (tensors on the model's device)."""

    slot_mapping: torch.Tensor  # [T] long: KV slot each new token is written to
    query_start_loc: torch.Tensor  # [B + 1] int32: first query row of each sequence, then T
    seq_lens: torch.Tensor  # [B] int32: context length of each sequence once this step's tokens are in
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # the same facts as host lists, for code that splits the batch in Python (the torch reference)
    query_lens_host: list[int]
    seq_lens_host: list[int]
    # each sequence's [start, end) position spans whose tokens attend to each other both ways (Gemma 3's images;
    # a span's keys are all in the pool when its tokens attend), None when the step has none
    attend_spans: "list[tuple[tuple[int, int], ...]] | None" = None
    # the torch reference's split of this step, built by the first layer and reused by the others
    torch_plan: "_Plan | None" = field(default=None, repr=False, compare=False)
    # the native CPU kernel's per-row (sequence, visible length) tensors, built by its first layer
    native_rows: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, compare=False)
    # the same for sliding-window layers, one plan per window size
    torch_window_plans: "dict[int, _Plan]" = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              slot_mapping: list[int], device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Tensorize one step's ragged batch from plain lists."""
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        width = max((len(t) for t in block_tables), default=0) or 1
        tables = torch.zeros(len(block_tables), width, dtype=torch.int32)
        for i, t in enumerate(block_tables):
            tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        return cls(
            slot_mapping=to_device(slot_mapping, torch.long, device),
            query_start_loc=to_device(starts, torch.int32, device),
            seq_lens=to_device(seq_lens, torch.int32, device),
            block_tables=to_device(tables, torch.int32, device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_lens_host=list(query_lens),
            seq_lens_host=list(seq_lens),
        )


def span_ends(spans: tuple[tuple[int, int], ...], first: int, count: int) -> list[int]:
    """For query positions first .. first + count - 1 of one sequence: the end of the keys each sees before any
    window, its position + 1, or the end of the bidirectional span (`spans`, [start, end) each) it sits in."""
    ends = list(range(first + 1, first + count + 1))
    for a, b in spans:
        for p in range(max(a, first), min(b, first + count)):
            ends[p - first] = b
    return ends


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's k, v [T, Hkv, D] at their slots of one layer's pool (quantized for a q8_0 or fp8 pool)."""
    hkv, d = k_cache.shape[-2:]
    for cache, x in ((k_cache, k), (v_cache, v)):
        rows = quantize_kv(x, cache)
        if is_quantized(cache):  # as bytes: index_copy_ has no float8 kernel on every device
            cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
        cache.view(-1, hkv, d).index_copy_(0, slot_mapping, rows)


def _gather(cache: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of each row's blocks: [B, length, Hkv, D]."""
    b, bs = tables.shape[0], cache.shape[1]
    n_blocks = -(-length // bs)
    blocks = cache[tables[:, :n_blocks].long()]  # [B, n_blocks, bs, Hkv, D]
    return blocks.reshape(b, n_blocks * bs, *cache.shape[2:])[:, :length]


@dataclass
class _Plan:
    """How the torch reference splits one step (built once per step, shared by every layer)."""

    decode_rows: torch.Tensor | None  # [Bd] query rows of the one-token sequences
    decode_slots: torch.Tensor | None  # [Bd * decode_len] KV slot of each context position, flat (padding: any slot)
    decode_len: int  # longest decode context
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, decode_len] float64: 0 where key j is visible, -inf elsewhere
    all_decode: bool  # every row of the step is a decode (no scatter needed)
    prefills: list[tuple[int, int, int, torch.Tensor, torch.Tensor | None]]  # (start, n, length, table, mask or None: causal)


def _plan(meta: AttentionMetadata, device: torch.device, block_size: int, window: int | None = None) -> _Plan:
    """The step's split; with `window`, query at position p sees only keys p - window + 1 .. p (sliding window)."""
    cached = meta.torch_plan if window is None else meta.torch_window_plans.get(window)
    if cached is not None:
        return cached
    qlens, slens = meta.query_lens_host, meta.seq_lens_host
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    decode = [i for i, n in enumerate(qlens) if n == 1]
    rows = slots = mask = None
    length = 0
    if decode:
        rows = torch.tensor([starts[i] for i in decode], device=device)
        lens = torch.tensor([slens[i] for i in decode], device=device)
        length = max(slens[i] for i in decode)
        tables = meta.block_tables[torch.tensor(decode, device=device)].long()
        bs = block_size
        if window is not None and length > window:
            # only each row's last `window` positions: a sliding layer's work stays bounded by the window
            length = window
            pos = lens[:, None] - window + torch.arange(window, device=device)[None, :]  # [Bd, window]
            visible = pos >= 0
            pos = pos.clamp(min=0)
            slots = (tables.gather(1, pos // bs) * bs + pos % bs).reshape(-1)
        else:
            pos = torch.arange(length, device=device)
            # one flat index per step, so each layer gathers its K and V with a single indexing op each
            slots = (tables[:, pos // bs] * bs + pos % bs).reshape(-1)
            visible = pos[None, :] < lens[:, None]
            if window is not None:
                visible &= pos[None, :] >= lens[:, None] - window
        # additive, built once per step: SDPA would otherwise turn a boolean mask into this one in every layer
        # (the same where(mask, 0, -inf) it computes itself, so results are unchanged)
        visible = visible[:, None, None, :]
        mask = torch.zeros(visible.shape, dtype=torch.float64, device=device).masked_fill_(~visible, float("-inf"))
    prefills = []
    for i, n in enumerate(qlens):
        if n > 1:
            length_i, past = slens[i], slens[i] - n
            # no cached past: plain causal attention, which lets SDPA skip the masked half instead of computing it
            causal = None
            spans = meta.attend_spans[i] if meta.attend_spans is not None else ()
            if past > 0 or spans or (window is not None and length_i > window):
                keys = torch.arange(length_i, device=device)[None, :]
                qpos = (past + torch.arange(n, device=device))[:, None]
                ends = torch.tensor(span_ends(spans, past, n), device=device)[:, None]
                causal = keys < ends  # a span's tokens see the whole span (the window still bounds the past)
                if window is not None:
                    causal &= keys > qpos - window
            prefills.append((starts[i], n, length_i, meta.block_tables[i : i + 1], causal))
    plan = _Plan(rows, slots, length, mask, len(decode) == len(qlens), prefills)
    if window is None:
        meta.torch_plan = plan
    else:
        meta.torch_window_plans[window] = plan
    return plan


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None,
               gqa: bool, softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA over [B, H, Tq, D] x [B, Hkv, Tk, D] (mask: boolean or additive, None = causal); with `softcap`
    the scores become softcap * tanh(scores / softcap) before the mask (Gemma 2), computed explicitly; with
    `sinks` [H], head h's softmax denominator gains exp(sinks[h]) (a logit with no value: gpt-oss)."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=gqa)
    if gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        tq, tk = scores.shape[-2:]
        mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask
    if sinks is None:
        return torch.softmax(scores, dim=-1) @ v
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1] @ v


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float | None = None, window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q [T, H, D] over each sequence's paged K/V; returns [T, H, D] in q's dtype (the tokens of
    one of `meta.attend_spans` see each other both ways).

    `window`: a sliding-window layer, where the query at position p sees keys p - window + 1 .. p only.
    `softcap`: attention-logit soft-capping (scores -> softcap * tanh(scores / softcap)).
    `sinks`: float32 [H] attention sinks, one learned logit per head added to its softmax denominator (gpt-oss).

    The K/V of this step's tokens must already be written (`write_kv`). Sequences with one query token
    (decodes) run together as one batched call; prefill chunks run one call each.
    """
    # float64 math, rounded once at the end: in bf16 or even float32 a row's result depends (in its last
    # bits) on how long the padded batch is and how the prompt was chunked, and greedy outputs then change
    # with whatever else is running; float64 differences vanish when rounded back
    out_dtype, q = q.dtype, q.double()
    if is_quantized(k_cache):  # attend over the dequantized values (the whole layer: a reference, not fast)
        k_cache, v_cache = dequantize_kv(k_cache), dequantize_kv(v_cache)
    gqa = q.shape[1] != k_cache.shape[2]
    plan = _plan(meta, q.device, k_cache.shape[1], window)
    if plan.decode_rows is not None:
        hkv, d = k_cache.shape[2:]
        gathered = (-1, plan.decode_len, hkv, d)  # index_select: a plain row copy, cheaper than tensor[index]
        k = k_cache.view(-1, hkv, d).index_select(0, plan.decode_slots).view(gathered).transpose(1, 2).double()
        v = v_cache.view(-1, hkv, d).index_select(0, plan.decode_slots).view(gathered).transpose(1, 2).double()
        qd = q.unsqueeze(2) if plan.all_decode else q[plan.decode_rows].unsqueeze(2)
        o = _attention(qd, k, v, plan.decode_mask, scale, gqa, softcap, sinks)
        if plan.all_decode:
            return o.squeeze(2).to(out_dtype)
    out = torch.empty_like(q)
    if plan.decode_rows is not None:
        out[plan.decode_rows] = o.squeeze(2)
    for start, n, length, table, mask in plan.prefills:
        k = _gather(k_cache, table, length).transpose(1, 2).double()
        v = _gather(v_cache, table, length).transpose(1, 2).double()
        qi = q[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        o = _attention(qi, k, v, mask, scale, gqa, softcap, sinks)
        out[start : start + n] = o.squeeze(0).transpose(0, 1)
    return out.to(out_dtype)
