"""W4A16 weights: the packed layout the Triton matmul reads, the one-time repack from Q4Blocks, and the torch twin.

Layout (`W4A16Weight`), for a weight W [N, K] (y = x @ W.T):
- `qweight` int32 [N, K // 8]: eight 4-bit values per int32, value k = 8 * i + j of a row in bits 4j..4j+3 of
  word i (two values per byte, low nibble first), so one row's K values are contiguous;
- `scales`, `offsets` [N, K // group_size] in the activation dtype: w = q * scale + offset per group. A zero point
  z (GGUF Q4_0's 8, Q4_1's -min/scale, AWQ/GPTQ's integer zeros) is the offset -z * scale.
K must be a multiple of 8 and of the group size, and the group size a multiple of 8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from edgeserve.kernels.formats.grouped import PackedWeight, dequantized_matmul
from edgeserve.kernels.formats.quant_linear import Q4Blocks


@dataclass
class W4A16Weight(PackedWeight):
    """A 4-bit weight packed for the W4A16 kernels (see the module docstring for the layout)."""

    qweight: torch.Tensor  # int32 [N, K // 8]
    scales: torch.Tensor  # [N, K // group_size], activation dtype
    offsets: torch.Tensor  # [N, K // group_size], activation dtype
    group_size: int
    VALUES_PER_ELEMENT: ClassVar[int] = 8

    def unpack(self) -> torch.Tensor:
        """The 4-bit values as uint8 [N, K]."""
        shifts = torch.arange(0, 32, 4, device=self.qweight.device, dtype=torch.int32)
        q = (self.qweight.unsqueeze(-1) >> shifts) & 0xF
        return q.reshape(self.out_features, self.in_features).to(torch.uint8)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K], from the stored (rounded) scales and offsets."""
        n, k, g = self.out_features, self.in_features, self.group_size
        q = self.unpack().float().view(n, k // g, g)
        w = q * self.scales.float().unsqueeze(-1) + self.offsets.float().unsqueeze(-1)
        return w.reshape(n, k)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [N, K] (K a multiple of 8) -> int32 [N, K // 8], low nibble first."""
    n, k = q.shape
    if k % 8:
        raise ValueError(f"in_features {k} is not a multiple of 8")
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    words = ((q.to(torch.int64).view(n, k // 8, 8) & 0xF) << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # as two's complement int32
    return words.to(torch.int32).contiguous()


def repack_q4(blocks: Q4Blocks, dtype: torch.dtype = torch.float16, device: torch.device | str | None = None) -> W4A16Weight:
    """Repack a Q4Blocks weight (done once at load) into the W4A16 layout, scales and offsets in `dtype`."""
    n, k = blocks.shape
    g = blocks.group_size
    if k % g or g % 8:
        raise ValueError(f"in_features {k} and group size {g} do not fit the W4A16 layout")
    device = device if device is not None else blocks.q.device
    return W4A16Weight(
        qweight=pack_int4(blocks.q).to(device),
        scales=blocks.scale.to(device=device, dtype=dtype).contiguous(),
        offsets=blocks.offset.to(device=device, dtype=dtype).contiguous(),
        group_size=g,
    )


w4a16_matmul = dequantized_matmul  # the torch twin of kernels.triton.w4a16
