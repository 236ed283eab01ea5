"""Triton pieces the quantized matmul kernels (w4a16, w8a16) share: the program's output tile and its activation
tile, and the host side's flat input rows and output."""

from __future__ import annotations

import torch

from edgeserve.kernels.triton.runtime import tl, triton


@triton.jit
def output_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(rows m, columns n, their masks) of this program's [BLOCK_M, BLOCK_N] output tile (grid axes 0 and 1)."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return m, n, m < M, n < N


@triton.jit
def x_tile(x_ptr, m, m_mask, k0, K, stride_xm, BLOCK_K: tl.constexpr):
    """Activation rows m, columns k0 .. k0 + BLOCK_K ([BLOCK_M, BLOCK_K], 0 outside)."""
    k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + k[None, :],
                   mask=m_mask[:, None] & (k < K)[None, :], other=0.0)


def matmul_rows(x: torch.Tensor, in_features: int, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [..., K] as rows [M, K] with unit column stride, the output [M, N] in x's dtype to fill)."""
    x2 = x.reshape(-1, in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2, torch.empty(x2.shape[0], out_features, dtype=x.dtype, device=x.device)
