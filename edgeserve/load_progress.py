"""A one-line "loading MODEL ... Ns" indicator on a terminal while a model loads (nothing when not a terminal)."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


class LoadingLine:
    """Context manager: redraws `loading NAME ... Ns` once a second on `out` if it is a terminal, erases it at
    the end, so the reply starts on a clean line; prints nothing when `out` is a pipe or file."""

    def __init__(self, name: str, out: TextIO = sys.stderr, enabled: bool | None = None) -> None:
        self.name, self.out = name, out
        self.enabled = _isatty(out) if enabled is None else enabled
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "LoadingLine":
        if self.enabled:
            self._start = time.monotonic()
            self._draw()
            self._thread = threading.Thread(target=self._redraw, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
            self.out.write("\r\033[K")  # erase the line
            self.out.flush()

    def _redraw(self) -> None:
        while not self._done.wait(1.0):
            self._draw()

    def _draw(self) -> None:
        self.out.write(f"\rloading {self.name} ... {time.monotonic() - self._start:.0f}s")
        self.out.flush()


def _isatty(out: TextIO) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):
        return False
