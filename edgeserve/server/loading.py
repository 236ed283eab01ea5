"""Waiting for a model load inside a response that has already started (headers sent, keep-alive items)."""

from __future__ import annotations

from typing import Any, AsyncIterator

import anyio

from edgeserve.server.config import UNSET
from edgeserve.server.model_manager import Lease, ModelManager

LOAD_PING_SECONDS = 1.0


def is_loaded(manager: ModelManager, name: str) -> bool:
    """Whether `name` is loaded now (an unknown name raises UnknownModelError, so it still gets its 404)."""
    mid, _ = manager.canonical(name)
    entry = manager.entries.get(mid)
    return entry is not None and entry.state == "loaded"


async def acquire_with_pings(manager: ModelManager, name: str, keep_alive: Any = UNSET,
                             interval: float | None = None) -> AsyncIterator[Lease | None]:
    """Yield None every `interval` seconds while the model loads, then the lease (last item).

    Each wait is a cancellable acquire(): the load itself runs in the manager's task group and goes on, so
    waiting again joins the same load. Load errors are raised to the caller.
    """
    interval = LOAD_PING_SECONDS if interval is None else interval
    while True:
        lease = None
        with anyio.move_on_after(interval):
            lease = await manager.acquire(name, keep_alive)
        if lease is not None:  # no yield inside the cancel scope: the consumer must not run under it
            yield lease
            return
        yield None
