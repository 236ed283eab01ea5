"""Dequantize GGUF tensor data to float (placeholder over gguf.quants; replaced by our vectorized torch code)."""

from __future__ import annotations

import numpy as np
import torch

SUPPORTED_QTYPES = frozenset({"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"})


def dequantize(raw: np.ndarray, qtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Stored GGUF data of type `qtype` -> float32 tensor of `shape` (torch order)."""
    from gguf import GGMLQuantizationType, quants

    out = quants.dequantize(np.asarray(raw), GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(shape)
