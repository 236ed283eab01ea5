"""W4A16 matmul in Triton over the `W4A16Weight` layout (twin: `w4a16.w4a16_matmul`).

Two paths: small M (decode) runs a GEMV-like kernel, one program per (block of output rows, input row),
streaming the packed weight along K (rows of one input after another hit L2); large M (prefill) runs a tiled
matmul that dequantizes a [BLOCK_N, BLOCK_K] weight tile in registers and feeds `tl.dot`. Both load each
packed int32 word once and split it into nibbles in registers; float32 accumulation throughout.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from edgeserve.kernels.triton.matmul_tiles import matmul_rows, output_tile, x_tile
from edgeserve.kernels.triton.runtime import INVARIANT_BLOCK_M, batch_invariant, dot_dtype, dot_precision, tl, triton
from edgeserve.kernels.formats.w4a16 import W4A16Weight

GEMV_MAX_M = 4  # up to this many rows the GEMV path; more take the tiled path


@dataclass(frozen=True)
class GemvConfig:
    """Launch shape of the GEMV kernel: rows per program, packed words per row per step, warps, and how many
    programs the K splits should bring the grid up to (per multiprocessor)."""

    # defaults: the best of an 81-shape sweep on an H100 over the Llama-3-8B matrices (docs/perf-log/2026-11-to-12.md, GPU)
    block_n: int = 4
    block_w: int = 128
    num_warps: int = 2
    programs_per_sm: int = 8


GEMV_CONFIG = GemvConfig()


@triton.jit
def _w4a16_gemv_kernel(x_ptr, qw_ptr, s_ptr, o_ptr, y_ptr, N, KW, stride_xm, stride_qn, stride_sn, stride_ym,
                       WORDS_PER_SPLIT, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                       PARTIAL: tl.constexpr):
    """y[m, n] (+)= sum over one K split of x[m, k] W[n, k], for a block of rows and one input row.

    The packed words are loaded once as a [BLOCK_N, BLOCK_W] tile and never reshaped (a reshape costs a layout
    shuffle through shared memory): each of the eight nibble positions is shifted out in turn and multiplied by
    the strided slice of x it pairs with. The eight values of a word share their group, so the scale and offset
    apply once per word: sum(x q) * scale + sum(x) * offset. With several K splits, each writes its float32
    partial sums to its own slice of a [splits, M, N] buffer.
    """
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    w_begin = tl.program_id(2) * WORDS_PER_SPLIT
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    n64 = n.to(tl.int64)
    acc = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    for w0 in range(w_begin, w_begin + WORDS_PER_SPLIT, BLOCK_W):
        w_idx = w0 + tl.arange(0, BLOCK_W)
        w_mask = w_idx < KW
        mask = n_mask[:, None] & w_mask[None, :]
        words = tl.load(qw_ptr + n64[:, None] * stride_qn + w_idx[None, :], mask=mask, other=0)
        g = (w_idx * 8) // GROUP
        scale = tl.load(s_ptr + n64[:, None] * stride_sn + g[None, :], mask=mask, other=0.0).to(tl.float32)
        offset = tl.load(o_ptr + n64[:, None] * stride_sn + g[None, :], mask=mask, other=0.0).to(tl.float32)
        dot = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
        xsum = tl.zeros([BLOCK_W], dtype=tl.float32)
        for i in tl.static_range(8):
            xi = tl.load(x_ptr + m * stride_xm + w_idx * 8 + i, mask=w_mask, other=0.0).to(tl.float32)
            dot += ((words >> (4 * i)) & 0xF).to(tl.float32) * xi[None, :]
            xsum += xi
        acc += dot * scale + offset * xsum[None, :]
    out = tl.sum(acc, axis=1)
    if PARTIAL:  # one float32 slice per K split, summed afterwards in a fixed order (atomics would not be)
        tl.store(y_ptr + tl.program_id(2) * N * tl.num_programs(1) + m * stride_ym + n, out, mask=n_mask)
    else:
        tl.store(y_ptr + m * stride_ym + n, out.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _dequant_rows(qw_ptr, s_ptr, o_ptr, n, n_mask, k0, K, stride_qn, stride_sn,
                  GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Float32 weight tile [BLOCK_N, BLOCK_K] of rows n, columns k0 .. k0 + BLOCK_K.

    Each packed int32 word is loaded once (contiguous along K) and split into its eight nibbles; a word never
    straddles a group (the group size is a multiple of 8), so scales and offsets are per word.
    """
    w_idx = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    n = n.to(tl.int64)
    mask = n_mask[:, None] & (w_idx < K // 8)[None, :]
    words = tl.load(qw_ptr + n[:, None] * stride_qn + w_idx[None, :], mask=mask, other=0)  # [BLOCK_N, BLOCK_K // 8]
    g = (w_idx * 8) // GROUP
    scale = tl.load(s_ptr + n[:, None] * stride_sn + g[None, :], mask=mask, other=0.0).to(tl.float32)
    offset = tl.load(o_ptr + n[:, None] * stride_sn + g[None, :], mask=mask, other=0.0).to(tl.float32)
    shifts = tl.arange(0, 8) * 4
    q = (words[:, :, None] >> shifts[None, None, :]) & 0xF  # [BLOCK_N, BLOCK_K // 8, 8], k = 8 * word + nibble
    w = q.to(tl.float32) * scale[:, :, None] + offset[:, :, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


@triton.jit
def _w4a16_tiled_kernel(x_ptr, qw_ptr, s_ptr, o_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_ym,
                        K_PER_SPLIT, GROUP: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr):
    """y[m, n] (+)= sum over one K split of x[m, k] W[n, k] for a [BLOCK_M, BLOCK_N] tile; with several splits
    (grid axis 2) each writes float32 partial sums to its own slice of a [splits, M, N] buffer."""
    m, n, m_mask, n_mask = output_tile(M, N, BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_begin = tl.program_id(2) * K_PER_SPLIT
    for k0 in range(k_begin, k_begin + K_PER_SPLIT, BLOCK_K):
        x = x_tile(x_ptr, m, m_mask, k0, K, stride_xm, BLOCK_K)
        w = _dequant_rows(qw_ptr, s_ptr, o_ptr, n, n_mask, k0, K, stride_qn, stride_sn, GROUP, BLOCK_N, BLOCK_K)
        acc += tl.dot(x.to(tl.float32).to(DOT), tl.trans(w.to(DOT)), input_precision=PRECISION)
    out_mask = m_mask[:, None] & n_mask[None, :]
    if PARTIAL:
        base = y_ptr + tl.program_id(2).to(tl.int64) * M * N
        tl.store(base + m[:, None].to(tl.int64) * N + n[None, :], acc, mask=out_mask)
    else:
        tl.store(y_ptr + m[:, None].to(tl.int64) * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=out_mask)


@dataclass(frozen=True)
class InvariantConfig:
    """Launch shape of the batch-invariant path: one row-tile height for every M, and a K split that follows the
    weight and the device alone (never M), so a row's sums are the same whatever is batched beside it."""

    block_n: int = 64
    block_k: int = 64
    programs_per_sm: int = 4


INVARIANT_CONFIG = InvariantConfig()


def invariant_matmul(x2: torch.Tensor, weight: W4A16Weight, y: torch.Tensor, config: InvariantConfig) -> None:
    """y [M, N] = x2 [M, K] @ W.T through 16-row tiles for every M, split along K by the weight's shape alone."""
    m, n, k = x2.shape[0], weight.out_features, weight.in_features
    steps = triton.cdiv(k, config.block_k)
    col_programs = triton.cdiv(n, config.block_n)
    split = max(1, min(steps, (config.programs_per_sm * _sm_count(x2.device)) // col_programs))
    k_per_split = triton.cdiv(steps, split) * config.block_k
    split = triton.cdiv(k, k_per_split)
    out = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=y.device)
    qw, s, o = weight.qweight, weight.scales, weight.offsets
    _w4a16_tiled_kernel[(triton.cdiv(m, INVARIANT_BLOCK_M), col_programs, split)](
        x2, qw, s, o, out, m, n, k, x2.stride(0), qw.stride(0), s.stride(0), y.stride(0), k_per_split,
        GROUP=weight.group_size, DOT=dot_dtype(x2.dtype), PRECISION=dot_precision(x2.dtype), BLOCK_M=INVARIANT_BLOCK_M,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, PARTIAL=split > 1,
    )
    if split > 1:
        y.copy_(out.sum(dim=0))


def w4a16_matmul(x: torch.Tensor, weight: W4A16Weight, gemv_max_m: int = GEMV_MAX_M) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x's dtype, with float32 accumulation."""
    k, n = weight.in_features, weight.out_features
    x2, y = matmul_rows(x, k, n)
    m = x2.shape[0]
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    if batch_invariant():
        invariant_matmul(x2, weight, y, INVARIANT_CONFIG)
    elif m <= gemv_max_m:
        gemv(x2, weight, y, GEMV_CONFIG)
    else:
        qw, s, o = weight.qweight, weight.scales, weight.offsets
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
        block_n, block_k = 64, 32
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), 1)
        _w4a16_tiled_kernel[grid](
            x2, qw, s, o, y, m, n, k, x2.stride(0), qw.stride(0), s.stride(0), y.stride(0),
            triton.cdiv(k, block_k) * block_k,
            GROUP=weight.group_size, DOT=dot_dtype(x.dtype), PRECISION=dot_precision(x.dtype), BLOCK_M=block_m,
            BLOCK_N=block_n, BLOCK_K=block_k, PARTIAL=False,
        )
    return y.reshape(*x.shape[:-1], n)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def gemv(x2: torch.Tensor, weight: W4A16Weight, y: torch.Tensor, config: GemvConfig) -> None:
    """y [M, N] = x2 [M, K] @ W.T for a few rows M, split along K where the rows alone are too few programs to
    keep every multiprocessor streaming."""
    m, n = x2.shape[0], weight.out_features
    kw = weight.in_features // 8
    steps = triton.cdiv(kw, config.block_w)
    # the split depends on the weight alone, never on M: a row's sum is the same whatever else is batched with it
    row_programs = triton.cdiv(n, config.block_n)
    split = max(1, min(steps, (config.programs_per_sm * _sm_count(x2.device)) // row_programs))
    words_per_split = triton.cdiv(steps, split) * config.block_w
    split = triton.cdiv(kw, words_per_split)
    qw, s, o = weight.qweight, weight.scales, weight.offsets
    out = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=y.device)
    _w4a16_gemv_kernel[(triton.cdiv(n, config.block_n), m, split)](
        x2, qw, s, o, out, n, kw, x2.stride(0), qw.stride(0), s.stride(0), n if split > 1 else out.stride(0),
        words_per_split, GROUP=weight.group_size, BLOCK_N=config.block_n, BLOCK_W=config.block_w,
        PARTIAL=split > 1, num_warps=config.num_warps,
    )
    if split > 1:
        y.copy_(out.sum(dim=0))
