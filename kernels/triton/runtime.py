"""Optional Triton: whether it imports, whether kernels run in its CPU interpreter, dtype helpers.

Triton decides at decoration time (when a `triton_*` module is first imported) whether `@triton.jit`
compiles for the GPU or interprets on CPU tensors (`TRITON_INTERPRET=1`); the dispatch imports those
modules lazily, so setting the variable before the first Triton kernel call is enough.
"""

from __future__ import annotations

import os

import torch

try:  # Triton is optional: everything falls back to the torch twins without it
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except Exception:  # ImportError, or a broken install that fails while importing
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False


def interpreting() -> bool:
    """Whether Triton kernels run in the interpreter (TRITON_INTERPRET set to a true value)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def dot_dtype(dtype: torch.dtype):
    """The Triton dtype that `tl.dot` operands are cast to for tensors of `dtype`.

    Half types on the GPU (tensor cores, fp32 accumulation); float32 otherwise, and always under the
    interpreter, whose bfloat16 arithmetic is not reliable (it computes on numpy, which has no bfloat16).
    """
    if interpreting() or dtype == torch.float32:
        return tl.float32
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (and >= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def batch_invariant() -> bool:
    """Whether the quantized GPU matmuls take one tiled path for every batch size (EDGESERVE_BATCH_INVARIANT set
    to a true value), so that a row's result does not depend on how many rows are batched with it. Off by default:
    the GEMV path for a few rows is faster, but it sums in another order than the tiled path for more rows."""
    return os.environ.get("EDGESERVE_BATCH_INVARIANT", "0").strip().lower() in ("1", "true", "on", "yes")


INVARIANT_BLOCK_M = 16  # the one row-tile height of the batch-invariant path


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot`'s input_precision for operands of `dot_dtype(dtype)`: exact float32 ("ieee", not TF32) when the
    operands are float32, so the float32 path matches its twin on a GPU too; the default for half types."""
    return "ieee" if dot_dtype(dtype) == tl.float32 else "tf32"
