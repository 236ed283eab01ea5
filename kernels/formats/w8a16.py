"""W8A16 weights: the layout the Triton matmul reads, the one-time conversion from Q8Blocks, and the torch twin.

Layout (`W8A16Weight`), for a weight W [N, K] (y = x @ W.T):
- `qweight` int8 [N, K]: the codes, one row's K values contiguous;
- `scales` [N, K // group_size], float16, bfloat16 or float32 (the kernels read them as float32, whatever the
  activation dtype): w = q * scale per group (symmetric, no zero point; GGUF Q8_0 is group 32 with float16 scales).
K must be a multiple of the group size, and the group size a power of two (the kernel splits tiles into groups).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from edgeserve.kernels.formats.grouped import PackedWeight, dequantized_matmul
from edgeserve.kernels.formats.quant_linear import Q8Blocks


@dataclass
class W8A16Weight(PackedWeight):
    """An 8-bit weight laid out for the W8A16 kernels (see the module docstring for the layout)."""

    qweight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # [N, K // group_size], float16 / bfloat16 / float32
    group_size: int
    VALUES_PER_ELEMENT: ClassVar[int] = 1

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K], from the stored (rounded) scales."""
        n, k, g = self.out_features, self.in_features, self.group_size
        w = self.qweight.float().view(n, k // g, g) * self.scales.float().unsqueeze(-1)
        return w.reshape(n, k)


def repack_q8(blocks: Q8Blocks, dtype: torch.dtype = torch.float16, device: torch.device | str | None = None) -> W8A16Weight:
    """Lay out a Q8Blocks weight (done once at load) for the W8A16 kernels, codes kept as int8, scales in `dtype`."""
    n, k = blocks.shape
    g = blocks.group_size
    if g <= 0 or g & (g - 1) or k % g:
        raise ValueError(f"in_features {k} and group size {g} do not fit the W8A16 layout")
    device = device if device is not None else blocks.q.device
    return W8A16Weight(
        qweight=blocks.q.to(device).contiguous(),
        scales=blocks.scale.to(device=device, dtype=dtype).contiguous(),
        group_size=g,
    )


w8a16_matmul = dequantized_matmul  # the torch twin of kernels.triton.w8a16
