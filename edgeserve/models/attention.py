"""The attention contract between the decoder and a KV cache, and a contiguous single-sequence cache."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class KVAttention(Protocol):
    """Stores this step's K/V for layer `layer` and returns attention output [tokens, heads * head_dim]."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, window: int | None = None,
                     softcap: float | None = None, scale: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [T, H, D] over k/v [past + T, Hkv, D], query i seeing keys up to past + i (GQA aware);
    with `window`, only the last `window` of them; `softcap` / `scale` / `sinks` as in kernels.torch.paged_attention."""
    from edgeserve.kernels.torch.paged_attention import _attention

    t, s = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    mask = None
    if t > 1 or window is not None or softcap is not None or sinks is not None:
        keys = torch.arange(s, device=q.device)[None, :]
        qpos = (past + torch.arange(t, device=q.device))[:, None]
        mask = keys <= qpos
        if window is not None:
            mask &= keys > qpos - window
    if mask is None:  # one query sees every key
        out = F.scaled_dot_product_attention(qh, kh, vh, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    else:
        out = _attention(qh, kh, vh, mask, scale, q.shape[1] != k.shape[1], softcap, sinks)
    return out.squeeze(0).transpose(0, 1).reshape(t, -1)


class ContiguousKV:
    """One sequence's K/V in preallocated [layers, max_len, kv_heads, head_dim] buffers."""

    def __init__(self, num_layers: int, max_len: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device="cpu"):
        self.k = torch.zeros(num_layers, max_len, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.max_len = max_len
        self.length = 0  # tokens stored and committed by `advance`

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None,
                 softcap: float | None = None, scale: float | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        start, end = self.length, self.length + q.shape[0]
        if end > self.max_len:
            raise ValueError(f"sequence of {end} tokens exceeds the cache of {self.max_len}")
        self.k[layer, start:end] = k
        self.v[layer, start:end] = v
        return causal_attention(q, self.k[layer, :end], self.v[layer, :end], start, window, softcap, scale, sinks)

    def advance(self, n: int) -> None:
        """Commit the `n` tokens just written to every layer."""
        self.length += n
