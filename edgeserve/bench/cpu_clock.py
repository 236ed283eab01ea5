"""The clock of a CPU microbenchmark: wall time, or one thread's CPU time with every kernel pinned to one thread."""

from __future__ import annotations

import os
import time
from typing import Callable

import torch


def cpu_clock(single_thread: bool) -> Callable[[], float]:
    """time.perf_counter; or, for `single_thread`, time.thread_time after limiting the native kernels
    (EDGESERVE_THREADS) and torch to one thread (steady on a busy machine)."""
    if not single_thread:
        return time.perf_counter
    os.environ["EDGESERVE_THREADS"] = "1"
    torch.set_num_threads(1)
    return time.thread_time
