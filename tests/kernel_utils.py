"""Shared setup for the kernel tests: Triton's CPU interpreter, the device parameter, tolerances, paged batches.

Imported by every tests/kernels/test_kernels_*.py at collection time, before any Triton kernel module is imported
(Triton fixes interpret-or-compile when a kernel is decorated). Without CUDA the kernels run in the
interpreter on CPU tensors; with CUDA they compile for the device and the `cuda` cases run instead.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from edgeserve.kernels.triton.runtime import HAS_TRITON, interpreting  # noqa: E402
from edgeserve.kernels.torch.paged_attention import AttentionMetadata  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

# Tolerances against the float32 twin. bfloat16 is loose on purpose: the GPU feeds tl.dot bfloat16 operands,
# and Triton's interpreter rounds float32 -> bfloat16 toward zero (up to one bf16 ulp, 2**-7 relative).
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def kernel_device(name: str) -> str:
    """Skip unless Triton can run kernels on `name` in this process; return the device."""
    if not HAS_TRITON:
        pytest.skip("triton is not importable (pip install triton)")
    if name == "cpu" and not interpreting():
        pytest.skip("Triton compiles for the GPU in this process; CPU cases need TRITON_INTERPRET=1")
    if name == "cuda" and interpreting():
        pytest.skip("TRITON_INTERPRET=1: the cuda cases test compiled Triton")
    return name


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float | None = None) -> None:
    """|actual - expected| <= tol(dtype) * (|expected| + scale), scale defaulting to max |expected| (or 1)."""
    a, e = actual.float().cpu(), expected.float().cpu()
    assert a.shape == e.shape, (a.shape, e.shape)
    assert torch.isfinite(a).all(), "non-finite output"
    s = float(e.abs().max()) if scale is None else scale
    s = max(s, 1.0) if scale is None else s
    err = (a - e).abs()
    bound = TOL[dtype] * (e.abs() + s)
    worst = float((err - bound).max())
    assert worst <= 0, f"max error {float(err.max()):.3g} over the {dtype} bound by {worst:.3g}"


def paged_batch(query_lens: list[int], seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype, device: str, seed: int = 0, spare_blocks: int = 3):
    """A KV pool filled with random K/V, shuffled block tables and metadata for one ragged step.

    Returns (k_cache, v_cache, meta); the K/V of the step's own tokens are already in the pool.
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = sum(-(-s // block_size) for s in seq_lens)
    num_blocks = need + spare_blocks
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, slots = [], []
    for q_len, s_len in zip(query_lens, seq_lens):
        table = [free.pop() for _ in range(-(-s_len // block_size))]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(s_len - q_len, s_len)]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, slots, device=device)
    return k_cache, v_cache, meta
