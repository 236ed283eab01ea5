"""The float32 merged weights a random LoRA adapter (edgeserve.bench.random_lora) stands for."""

from __future__ import annotations

import torch

from edgeserve.bench.random_lora import shapes


def merged_delta(pairs, scale: float, config, layer: int, fused: tuple[str, ...]) -> torch.Tensor:
    """The float32 [out, in] update scale * B A of the fused weight stacked from `fused` projections."""
    parts = []
    for p in fused:
        o, k = shapes(config)[p]
        a, b = pairs.get((layer, p), (torch.zeros(1, k), torch.zeros(o, 1)))
        parts.append(scale * b @ a)
    return torch.cat(parts)
