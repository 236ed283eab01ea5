"""Paged attention over a block-table KV pool: the torch reference (the Triton twins share these signatures).

The pool of one layer is `k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]`; slot s is
block s // block_size, offset s % block_size. A step is a flat ragged batch: sequence i owns query rows
query_start_loc[i]:query_start_loc[i+1], which are its last tokens, so its context is seq_lens[i] tokens
and query row j of it sees keys 0 .. seq_lens[i] - q_len + j.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=tables.to(device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_lens_host=list(query_lens),
            seq_lens_host=list(seq_lens),
        )


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's k, v [T, Hkv, D] at their slots of one layer's pool."""
    hkv, d = k_cache.shape[-2:]
    k_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather(cache: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of each row's blocks: [B, length, Hkv, D]."""
    b, bs = tables.shape[0], cache.shape[1]
    n_blocks = -(-length // bs)
    blocks = cache[tables[:, :n_blocks].long()]  # [B, n_blocks, bs, Hkv, D]
    return blocks.reshape(b, n_blocks * bs, *cache.shape[2:])[:, :length]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float | None = None) -> torch.Tensor:
    """Causal attention of q [T, H, D] over each sequence's paged K/V; returns [T, H, D] in q's dtype.

    The K/V of this step's tokens must already be written (`write_kv`). Sequences with one query token
    (decodes) run together as one batched call; prefill chunks run one call each.
    """
    # float32 math: bf16 probabilities make a row's result depend on how the batch was chunked
    out_dtype, q = q.dtype, q.float()
    out = torch.empty_like(q)
    gqa = q.shape[1] != k_cache.shape[2]
    qlens, slens = meta.query_lens_host, meta.seq_lens_host
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    decode = [i for i, n in enumerate(qlens) if n == 1]
    if decode:
        rows = torch.tensor([starts[i] for i in decode], device=q.device)
        lens = torch.tensor([slens[i] for i in decode], device=q.device)
        length = max(slens[i] for i in decode)
        tables = meta.block_tables[torch.tensor(decode, device=q.device)]
        k = _gather(k_cache, tables, length).transpose(1, 2).float()  # [B, Hkv, L, D]
        v = _gather(v_cache, tables, length).transpose(1, 2).float()
        mask = (torch.arange(length, device=q.device)[None, :] < lens[:, None])[:, None, None, :]
        o = F.scaled_dot_product_attention(q[rows].unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[rows] = o.squeeze(2)
    for i, n in enumerate(qlens):
        if n == 1:
            continue
        length, past = slens[i], slens[i] - n
        k = _gather(k_cache, meta.block_tables[i : i + 1], length).transpose(1, 2).float()
        v = _gather(v_cache, meta.block_tables[i : i + 1], length).transpose(1, 2).float()
        qi = q[starts[i] : starts[i] + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        mask = torch.arange(length, device=q.device)[None, :] <= (past + torch.arange(n, device=q.device))[:, None]
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[starts[i] : starts[i] + n] = o.squeeze(0).transpose(0, 1)
    return out.to(out_dtype)
