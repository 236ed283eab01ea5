"""Waiting for a model load inside a response that has already started (headers sent, keep-alive comments)."""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable

import anyio

from edgeserve.server.config import UNSET
from edgeserve.server.errors import APIError, from_exception
from edgeserve.server.generation import Generation
from edgeserve.server.model_manager import Lease, ModelManager
from edgeserve.server.state import server_state

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


async def start_generation(request: Any, req: Any, prompt_param: str,
                           constraint_param: str = "response_format") -> Generation:
    """Lease the model, set up the request (template, tools, grammar compiled: 400s come here) and submit it.

    `prompt_param` / `constraint_param` are the request fields a too-long prompt / a bad grammar name."""
    st = server_state(request)
    lease = await st.manager.acquire(req.model, req.keep_alive)
    gen = Generation(lease, req, st.metrics, request.state.request_id, prompt_param)
    gen.constraint_param = constraint_param
    await gen.prepare()
    gen.submit()
    return gen


async def stream_after_load(request: Any, req: Any, prompt_param: str,
                            events: Callable[[Generation], AsyncIterator[Any]],
                            on_error: Callable[[APIError], Any], ping: Any,
                            constraint_param: str = "response_format") -> AsyncIterator[Any]:
    """A streamed response's body for a model not loaded yet: `ping` items while it loads, then `events(gen)`.

    Errors before the first event (the load failed, the prompt is too long) come in-band as `on_error(err)`,
    since the headers are already sent. `constraint_param` is the field a grammar error names.
    """
    st = server_state(request)
    gen = None
    try:
        async for lease in acquire_with_pings(st.manager, req.model, req.keep_alive):
            if lease is None:
                if ping is not None:
                    yield ping
                continue
            gen = Generation(lease, req, st.metrics, request.state.request_id, prompt_param)
            gen.constraint_param = constraint_param
            await gen.prepare()
            gen.submit()
    except Exception as e:
        yield on_error(from_exception(e, request.state.request_id))
        return
    assert gen is not None
    async for item in events(gen):
        yield item
