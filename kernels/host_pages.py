"""Host memory pages under weights: let a process drop its mapping of file pages it has copied elsewhere."""

from __future__ import annotations

import mmap

import numpy as np


def release_pages(view: np.ndarray) -> bool:
    """Let go of this process's mapping of the file pages under `view` (a view of a GGUF's mmap, as GGUFFile.raw
    gives) once its bytes have been copied elsewhere: madvise(MADV_DONTNEED) over the whole pages it covers. The
    pages stay in the page cache (clean, for the kernel to drop under pressure) but no longer count in this
    process's resident memory; reading the view again maps them back in, with the same bytes. True when released;
    False for anything that is not a view of an mmap (a copy, a tensor, bytes) or where madvise is missing."""
    if not isinstance(view, np.ndarray) or not hasattr(mmap, "MADV_DONTNEED") or view.size == 0:
        return False
    base = view
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None) if not isinstance(base, memoryview) else base.obj
    if base is None or not view.flags.c_contiguous:
        return False
    start = view.ctypes.data - np.frombuffer(base, np.uint8, 0).ctypes.data
    page = mmap.PAGESIZE
    lo, hi = -(-start // page) * page, (start + view.nbytes) // page * page  # whole pages only: neighbours keep theirs
    if hi > lo:
        try:
            base.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        except (OSError, ValueError):
            return False
    return True
