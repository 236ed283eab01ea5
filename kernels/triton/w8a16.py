"""W8A16 matmul in Triton over the `W8A16Weight` layout (twin: `w8a16.w8a16_matmul`).

Two paths: small M (decode) runs a GEMV-like kernel, one program per (block of output rows, input row),
streaming the int8 weight along K (rows of one input after another hit L2); large M (prefill) runs a tiled
matmul that dequantizes a [BLOCK_N, BLOCK_K] weight tile in registers and feeds `tl.dot`. Both load each int8
code once and each group's scale once per tile; float32 accumulation throughout. Block sizes mirror the W4A16
kernels and have not been tuned on a GPU.
"""

from __future__ import annotations

import torch

from edgeserve.kernels.triton.matmul_tiles import matmul_rows, output_tile, x_tile
from edgeserve.kernels.triton.runtime import INVARIANT_BLOCK_M, batch_invariant, dot_dtype, dot_precision, tl, triton
from edgeserve.kernels.formats.w8a16 import W8A16Weight

GEMV_MAX_M = 4  # up to this many rows the GEMV path; more take the tiled path


@triton.jit
def _dequant_rows(qw_ptr, s_ptr, n, n_mask, k0, K, stride_qn, stride_sn,
                  GROUP: tl.constexpr, SUB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Float32 weight tile [BLOCK_N, BLOCK_K] of rows n, columns k0 .. k0 + BLOCK_K.

    The tile is loaded as [BLOCK_N, BLOCK_K // SUB, SUB] with SUB = min(GROUP, BLOCK_K): each SUB-wide run of
    codes lies in one group, so scales are loaded per run, not per code. K is a multiple of SUB (both powers of
    two dividing into GROUP), so a run is wholly in or out of range.
    """
    run = k0 // SUB + tl.arange(0, BLOCK_K // SUB)
    n = n.to(tl.int64)
    mask = n_mask[:, None] & (run < K // SUB)[None, :]  # [BLOCK_N, BLOCK_K // SUB]
    scale = tl.load(s_ptr + n[:, None] * stride_sn + ((run * SUB) // GROUP)[None, :], mask=mask, other=0.0)
    k = run[:, None] * SUB + tl.arange(0, SUB)[None, :]  # [BLOCK_K // SUB, SUB]
    q = tl.load(qw_ptr + n[:, None, None] * stride_qn + k[None, :, :], mask=mask[:, :, None], other=0)
    w = q.to(tl.float32) * scale.to(tl.float32)[:, :, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


@triton.jit
def _w8a16_gemv_kernel(x_ptr, qw_ptr, s_ptr, y_ptr, N, K, stride_xm, stride_qn, stride_sn, stride_ym,
                       GROUP: tl.constexpr, SUB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
        w = _dequant_rows(qw_ptr, s_ptr, n, n_mask, k0, K, stride_qn, stride_sn, GROUP, SUB, BLOCK_N, BLOCK_K)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(y_ptr + m * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _w8a16_tiled_kernel(x_ptr, qw_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_ym,
                        GROUP: tl.constexpr, SUB: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    m, n, m_mask, n_mask = output_tile(M, N, BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = x_tile(x_ptr, m, m_mask, k0, K, stride_xm, BLOCK_K)
        w = _dequant_rows(qw_ptr, s_ptr, n, n_mask, k0, K, stride_qn, stride_sn, GROUP, SUB, BLOCK_N, BLOCK_K)
        acc += tl.dot(x.to(tl.float32).to(DOT), tl.trans(w.to(DOT)), input_precision=PRECISION)
    tl.store(y_ptr + m[:, None].to(tl.int64) * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def w8a16_matmul(x: torch.Tensor, weight: W8A16Weight, gemv_max_m: int = GEMV_MAX_M) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x's dtype, with float32 accumulation."""
    k, n, g = weight.in_features, weight.out_features, weight.group_size
    x2, y = matmul_rows(x, k, n)
    m = x2.shape[0]
    qw, s = weight.qweight, weight.scales
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    invariant = batch_invariant()
    if m <= gemv_max_m and not invariant:
        block_n, block_k = 32, 128
        _w8a16_gemv_kernel[(triton.cdiv(n, block_n), m)](
            x2, qw, s, y, n, k, x2.stride(0), qw.stride(0), s.stride(0), y.stride(0),
            GROUP=g, SUB=min(g, block_k), BLOCK_N=block_n, BLOCK_K=block_k,
        )
    else:
        block_m = INVARIANT_BLOCK_M if invariant else (16 if m <= 16 else (32 if m <= 32 else 64))
        block_n, block_k = 64, 32
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _w8a16_tiled_kernel[grid](
            x2, qw, s, y, m, n, k, x2.stride(0), qw.stride(0), s.stride(0), y.stride(0),
            GROUP=g, SUB=min(g, block_k), DOT=dot_dtype(x.dtype), PRECISION=dot_precision(x.dtype),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        )
    return y.reshape(*x.shape[:-1], n)
