"""Work of a client that went away stops: an awaited step is cancelled when the client disconnects, and work in a
worker thread (image encodes) is told to stop at its next chunk boundary.

`unless_disconnected(request, awaitable)` runs the step while watching the connection; a disconnect cancels it and
raises `ClientGone` (the routes answer 499, which nobody reads). `run_abandonable(fn, ...)` runs `fn(..., abandoned)`
in a worker thread; when its caller is cancelled (the client left, the server is stopping) the caller returns at
once and `abandoned()` turns true, for `fn` to check between chunks."""

from __future__ import annotations

import logging
import threading
from typing import Any, Awaitable, Callable, TypeVar

import anyio
import anyio.to_thread
from starlette.requests import Request

log = logging.getLogger("edgeserve.server")
T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's status for a client that closed the connection before the reply


class ClientGone(Exception):
    """The client closed the connection before its reply was ready."""


async def unless_disconnected(request: Request, step: Awaitable[T]) -> T:
    """`await step`, cancelled when the client disconnects first (ClientGone then)."""
    gone = False
    result: Any = None

    async def watch(scope: anyio.CancelScope) -> None:
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone = True
        log.info("client disconnected; cancelling its work")
        scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch, tg.cancel_scope)
        result = await step
        tg.cancel_scope.cancel()
    if gone:
        raise ClientGone("the client disconnected")
    return result


async def run_abandonable(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args, abandoned)` in a worker thread. A cancelled caller returns at once; `abandoned()` is then true
    and `fn` should stop at its next chunk boundary (raising, say: nobody reads its result)."""
    flag = threading.Event()
    try:
        return await anyio.to_thread.run_sync(lambda: fn(*args, flag.is_set), abandon_on_cancel=True)
    finally:
        flag.set()  # after a result this changes nothing; after a cancel it stops the thread
