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


def q4_blocks(raw: np.ndarray, qtype: str, shape: tuple[int, ...]):
    """Placeholder (Q4_0/Q4_1 only): (q uint8 [rows, cols], scale, offset [rows, cols//32]) with w = q*scale + offset."""
    rows, cols = shape
    b = torch.from_numpy(np.ascontiguousarray(raw)).view(rows, cols // 32, -1)
    d = b[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)
    if qtype == "Q4_0":
        qs, off = b[..., 2:], -8 * d
    else:
        m = b[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)
        qs, off = b[..., 4:], m
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(rows, cols)
    return q, d, off
