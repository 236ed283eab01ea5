"""Process memory tuning (glibc): give freed weight-loading buffers back to the OS during a load, and let the steps
after it reuse their activation buffers' pages."""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections.abc import Iterator

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
STEP_MMAP_THRESHOLD = 32 << 20  # glibc's largest (64-bit)
STEP_TRIM_THRESHOLD = 256 << 20


def _mallopt(*settings: tuple[int, int]) -> None:
    """glibc's mallopt for each (parameter, value); a no-op where glibc is absent."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        for param, value in settings:
            libc.mallopt(param, value)
    except (OSError, AttributeError):
        pass


def release_large_frees_to_os() -> None:
    """Make glibc serve allocations >= 1 MiB with mmap, so loading temporaries are unmapped when freed.

    glibc otherwise raises its mmap threshold after the first large free, and the many
    per-tensor temporaries of a model load then stay in the heap and in RSS (measured: RSS
    after loading the default model 538 MB -> 381 MB). No-op where glibc is absent.
    """
    _mallopt((_M_MMAP_THRESHOLD, 1 << 20))


def reuse_step_buffers() -> None:
    """After a load: allocations up to 32 MiB come from the heap again, and up to 256 MiB of freed heap is kept, so
    each step's activation buffers reuse pages instead of mapping fresh zeroed ones. With the load's 1 MiB threshold
    left in place, a 1,000-token Qwen3.5-0.8B prefill (per-op path, megabyte outputs per kernel) took about 760,000
    page faults, about 1.4 s of system time beside 4 s of user time (docs/perf-log/2026-11-to-12.md)."""
    _mallopt((_M_MMAP_THRESHOLD, STEP_MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, STEP_TRIM_THRESHOLD))


@contextlib.contextmanager
def load_allocations() -> Iterator[None]:
    """Within: large frees go back to the OS (a model load's temporaries); after: steps reuse their buffers."""
    release_large_frees_to_os()
    try:
        yield
    finally:
        reuse_step_buffers()
