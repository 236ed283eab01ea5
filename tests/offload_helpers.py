"""Small KV layouts and random blocks for the offload tests."""

from __future__ import annotations

import torch

from edgeserve.engine.cache.kv_blocks import block_hash
from edgeserve.offload import KVLayout

LAYOUT = KVLayout(model_id="test-model", dtype=torch.bfloat16, num_layers=3, block_size=4, num_kv_heads=2,
                  head_dim=8)


def make_chain(n: int, layout: KVLayout = LAYOUT, seed: int = 0, start_token: int = 0):
    """`n` chained blocks: a list of (hash, parent_hash, token_ids, k, v) with random K/V."""
    g = torch.Generator().manual_seed(seed)
    out, parent = [], b""
    for i in range(n):
        tokens = tuple(range(start_token + i * layout.block_size, start_token + (i + 1) * layout.block_size))
        h = block_hash(parent, tokens)
        k = torch.randn(layout.shape, generator=g).to(layout.dtype)
        v = torch.randn(layout.shape, generator=g).to(layout.dtype)
        out.append((h, parent, tokens, k, v))
        parent = h
    return out
