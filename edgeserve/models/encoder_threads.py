"""Torch's intra-op (OpenMP) thread count for one encoder forward, set on the calling thread only.

An encoder whose layer matrices run on the native kernels (kernels/cpu/native.py BlockWeight) has two thread pools:
the native pool for the matmuls and torch's OpenMP team for the rest (LayerNorm, attention, GELU). Both spin
between jobs, so with torch's team at full size beside the native pool's workers there are more spinning threads
than cores and each side waits on a preempted thread of the other: a 64-token MiniLM text took 1.5x to 20x longer
with 2 torch threads than with 1 on a 2-core machine (docs/perf-log/2026-11-to-12.md). With one torch thread the native pool
alone runs in parallel, and the few non-matmul ops run on the calling thread.

`torch.set_num_threads` would also change the process-wide default that threads read when they first use torch
(a text model's engine thread started meanwhile would keep the small count), so the count is set through the
OpenMP runtime's own per-thread `omp_set_num_threads` instead, and put back afterwards.
"""

from __future__ import annotations

import ctypes
import logging
from contextlib import contextmanager
from typing import Any, Iterator

import torch

log = logging.getLogger(__name__)

_unset = object()
_omp: Any = _unset


def _omp_runtime() -> Any:
    """The loaded OpenMP runtime's (omp_set_num_threads, omp_get_max_threads), or None when torch has none."""
    global _omp
    if _omp is _unset:
        _omp = None
        if torch.backends.openmp.is_available():
            try:
                process = ctypes.CDLL(None)
                setter, getter = process.omp_set_num_threads, process.omp_get_max_threads
                setter.argtypes, setter.restype, getter.restype = [ctypes.c_int], None, ctypes.c_int
                _omp = (setter, getter)
            except (OSError, AttributeError, TypeError):  # TypeError: no CDLL(None) on Windows
                log.debug("no OpenMP runtime symbols in the process; encoder thread counts stay torch's")
    return _omp


@contextmanager
def intra_op_threads(n: int | None) -> Iterator[None]:
    """Run the block with torch's intra-op threads at `n` on this thread only (other threads keep theirs);
    None, or no OpenMP runtime to set it through, leaves the count as it is."""
    omp = _omp_runtime() if n is not None else None
    if omp is None:
        yield
        return
    setter, getter = omp
    torch.get_num_threads()  # torch sets a thread's count from its default on first use: let it do so first
    before = getter()
    if before == n:
        yield
        return
    setter(n)
    try:
        yield
    finally:
        setter(before)


SMALL_BATCH_TOKENS = 256  # a padded batch under this many tokens runs torch's ops on one thread


def uses_native_pool(weights: dict[str, Any]) -> bool:
    """Whether some of an encoder's layer matrices run on the native kernels' thread pool (quantized blocks, or
    16-bit matrices on the native bfloat16 kernel)."""
    from edgeserve.kernels.formats.bf16_weight import Bf16Weight
    from edgeserve.kernels.cpu.native import BlockWeight

    return any(isinstance(w, (BlockWeight, Bf16Weight)) for w in weights.values())


def encoder_threads(native: bool, tokens: int) -> int | None:
    """Torch's intra-op threads for an encoder forward over a padded batch of `tokens`: 1 beside the native pool
    (its threads do the matmuls) or for a batch under SMALL_BATCH_TOKENS (a single short text: a few ms of work,
    where a second thread's hand-overs cost about what it saves, and far more on a shared machine); else None
    (torch's own count: its GEMMs are the parallel work)."""
    return 1 if native or tokens < SMALL_BATCH_TOKENS else None
