"""Model weights under one naming (Hugging Face Llama names), whatever file they come from."""

from __future__ import annotations

from typing import Protocol

import torch

from edgeserve.kernels.cpu.native import BlockTensor
from edgeserve.kernels.formats.quant_linear import Q4Blocks, Q8Blocks

WeightValue = torch.Tensor | Q4Blocks | Q8Blocks | BlockTensor


class WeightSource(Protocol):
    """Lazy access to a model's tensors by HF name (`model.layers.0.self_attn.q_proj.weight`)."""

    def has(self, name: str) -> bool:
        """Whether the model has this tensor."""
        ...

    def get(self, name: str, keep_int4: bool) -> WeightValue:
        """The tensor, read now: float32, or (with `keep_int4`, for layer matrices) Q4Blocks when stored 4-bit
        and Q8Blocks when stored as GGUF Q8_0."""
        ...


def unpermute_qk(w: WeightValue, n_heads: int) -> WeightValue:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> rotate-half layout)."""
    rows = w.shape[0]
    head_dim = rows // n_heads
    idx = torch.arange(rows).view(n_heads, 2, head_dim // 2).transpose(1, 2).reshape(-1)
    # llama.cpp wrote row idx[j] of the HF weight at position j; invert that.
    inv = torch.empty_like(idx)
    inv[idx] = torch.arange(rows)
    if isinstance(w, (Q4Blocks, Q8Blocks, BlockTensor)):
        return w.rows(inv)
    return w[inv]
