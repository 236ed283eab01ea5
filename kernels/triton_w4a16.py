"""W4A16 matmul in Triton over the `W4A16Weight` layout (twin: `w4a16.w4a16_matmul`).

Two paths: small M (decode) runs a GEMV-like kernel, one program per (block of output rows, input row),
streaming the packed weight once per input row along K; large M (prefill) runs a tiled matmul that
dequantizes a [BLOCK_K, BLOCK_N] weight tile in registers and feeds `tl.dot`.
"""

from __future__ import annotations

import torch

from ._triton import dot_dtype, dot_precision, tl, triton
from .w4a16 import W4A16Weight

GEMV_MAX_M = 4  # up to this many rows the GEMV path; more take the tiled path


@triton.jit
def _dequant_tile(qw_ptr, s_ptr, o_ptr, n, k, n_mask, k_mask, stride_qn, stride_sn, GROUP: tl.constexpr):
    """Float32 weight tile for row indices n and column indices k (any broadcastable 2-D shapes)."""
    mask = n_mask & k_mask
    words = tl.load(qw_ptr + n * stride_qn + k // 8, mask=mask, other=0)
    q = (words >> ((k % 8) * 4)) & 0xF
    g = k // GROUP
    scale = tl.load(s_ptr + n * stride_sn + g, mask=mask, other=0.0).to(tl.float32)
    offset = tl.load(o_ptr + n * stride_sn + g, mask=mask, other=0.0).to(tl.float32)
    return q.to(tl.float32) * scale + offset


@triton.jit
def _w4a16_gemv_kernel(x_ptr, qw_ptr, s_ptr, o_ptr, y_ptr, N, K, stride_xm, stride_qn, stride_sn, stride_ym,
                       GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        x = tl.load(x_ptr + m * stride_xm + k, mask=k_mask, other=0.0).to(tl.float32)
        w = _dequant_tile(qw_ptr, s_ptr, o_ptr, n[:, None], k[None, :], n_mask[:, None], k_mask[None, :],
                          stride_qn, stride_sn, GROUP)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(y_ptr + m * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _w4a16_tiled_kernel(x_ptr, qw_ptr, s_ptr, o_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_ym,
                        GROUP: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = m < M
    n_mask = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        x = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = _dequant_tile(qw_ptr, s_ptr, o_ptr, n[None, :], k[:, None], n_mask[None, :], k_mask[:, None],
                          stride_qn, stride_sn, GROUP)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(x.to(tl.float32).to(DOT), w.to(DOT), input_precision=PRECISION)
    tl.store(y_ptr + m[:, None].to(tl.int64) * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def w4a16_matmul(x: torch.Tensor, weight: W4A16Weight, gemv_max_m: int = GEMV_MAX_M) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x's dtype, with float32 accumulation."""
    k, n = weight.in_features, weight.out_features
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    qw, s, o = weight.qweight, weight.scales, weight.offsets
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    if m <= gemv_max_m:
        block_n, block_k = 32, 128
        _w4a16_gemv_kernel[(triton.cdiv(n, block_n), m)](
            x2, qw, s, o, y, n, k, x2.stride(0), qw.stride(0), s.stride(0), y.stride(0),
            GROUP=weight.group_size, BLOCK_N=block_n, BLOCK_K=block_k,
        )
    else:
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
        block_n, block_k = 64, 32
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _w4a16_tiled_kernel[grid](
            x2, qw, s, o, y, m, n, k, x2.stride(0), qw.stride(0), s.stride(0), y.stride(0),
            GROUP=weight.group_size, DOT=dot_dtype(x.dtype), PRECISION=dot_precision(x.dtype), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        )
    return y.reshape(*x.shape[:-1], n)
