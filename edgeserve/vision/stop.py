"""Stopping an image encode whose request went away, between the tower's layers: the thread that encodes says what
to check (`checking(abandoned)`), the tower calls `check()` before each layer; true raises EncodeAbandoned."""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

_local = threading.local()


class EncodeAbandoned(RuntimeError):
    """The request whose images were being encoded went away."""


@contextlib.contextmanager
def checking(abandoned: Callable[[], bool] | None) -> Iterator[None]:
    """Within the block, `check()` on this thread raises once `abandoned()` is true."""
    before = getattr(_local, "abandoned", None)
    _local.abandoned = abandoned
    try:
        yield
    finally:
        _local.abandoned = before


def check() -> None:
    """Raise EncodeAbandoned when this thread's encode was abandoned (nothing to check: returns)."""
    abandoned = getattr(_local, "abandoned", None)
    if abandoned is not None and abandoned():
        raise EncodeAbandoned("the request went away: its images are not encoded")
