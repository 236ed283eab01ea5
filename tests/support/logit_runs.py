"""Our model's logits over a prompt and decode steps, the way the parity tests run it against transformers: a
contiguous KV cache, or the engine's paged pool with the prompt in two chunks."""

from __future__ import annotations

import torch

from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention
from edgeserve.kernels.dispatch import AttentionMetadata
from edgeserve.models.attention import ContiguousKV


def decode_ids(prompt: list[int], decodes: int) -> list[int]:
    """The prompt, then the decode inputs (40, 41, ...: the reference's next inputs)."""
    return prompt + list(range(40, 40 + decodes))


def contiguous_logits(model, prompt: list[int], decodes: int) -> torch.Tensor:
    """Prefill `prompt` then decode `decodes` tokens one at a time, over a contiguous float32 KV cache."""
    c = model.config
    kv = ContiguousKV(c.num_layers, 32, c.num_kv_heads, c.head_dim, torch.float32)
    ids = decode_ids(prompt, decodes)
    out = [model.logits(model.forward(torch.tensor(prompt), torch.arange(len(prompt)), kv))]
    kv.advance(len(prompt))
    for p in range(len(prompt), len(ids)):
        out.append(model.logits(model.forward(torch.tensor([ids[p]]), torch.tensor([p]), kv)))
        kv.advance(1)
    return torch.cat(out)


def paged_logits(model, prompt: list[int], decodes: int, block_size: int = 4,
                 kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The same through a paged pool of `kv_dtype` (default the model's dtype; window layers in the window pool):
    the prompt in two chunks (5 tokens, then the rest), then single-token decode steps."""
    ids = decode_ids(prompt, decodes)
    pool = KVPool(model.config, 8, block_size, kv_dtype or model.dtype)
    table = list(range(8))
    steps = [(0, 5), (5, len(prompt))] + [(p, p + 1) for p in range(len(prompt), len(ids))]
    out = []
    for a, b in steps:
        meta = AttentionMetadata.build([b - a], [b], [table], list(range(a, b)))
        attn = PagedKVAttention(pool, meta)
        out.append(model.logits(model.forward(torch.tensor(ids[a:b]), torch.arange(a, b), attn)))
    return torch.cat(out)
