"""Generations that outlive their connection, stored as they run (server/response_store.py): Responses background
mode (api/responses_background.py) and resumable OpenAI streams (`stream_options.resumable`).

`pump` runs a detached generation into its StoredResponse; `start_resumable` answers a resumable stream: the
request runs in the app's task group, the POST follows its stored events, and a client that drops reattaches by
the stream's id (GET /v1/chat/completions/{id}, GET /v1/completions/{id}, or the same POST again with a
`Last-Event-ID` header) within `resume_grace_seconds`, after which a stream nobody follows is cancelled."""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable

import anyio
from starlette.requests import Request
from starlette.responses import Response

from edgeserve.server.adapters import pick_adapter
from edgeserve.server.errors import bad_request
from edgeserve.server.request import GenerationRequest
from edgeserve.server.respond import detached, sse
from edgeserve.server.response_store import StoredResponse
from edgeserve.server.state import ServerState, server_state


def spawn(request: Request, req: GenerationRequest, entry: StoredResponse, run: Callable[..., Any],
          *args: Any) -> ServerState:
    """Check the request's model (a 404 now, not a failed run later), store `entry` and start `run(*args)` in the
    app's task group."""
    st = server_state(request)
    pick_adapter(st.manager, req)
    st.manager.canonical(req.model)
    if st.tasks is None:
        raise RuntimeError("the server's task group is not running")
    st.responses.add(entry)
    st.tasks.start_soon(run, *args)
    return st


async def pump(entry: StoredResponse, items: AsyncIterator[dict], each: Callable[[dict], None] | None = None) -> bool:
    """Store every item of a detached run in `entry` (calling `each` after each); False when it was cancelled
    (entry.scope: a client's cancel, an unwatched stream's grace, or the server stopping)."""
    try:
        with entry.scope:
            async for item in items:
                entry.add(item)
                if each is not None:
                    each(item)
            return True
        return False
    finally:
        with anyio.CancelScope(shield=True):
            await items.aclose()  # the engine requests are aborted and the model's lease goes back


def start_resumable(request: Request, req: GenerationRequest, replier: Any) -> Response:
    """A resumable stream: run `req` detached, stored under the replier's id; the POST follows its events."""
    entry = StoredResponse(replier.rid, {"id": replier.rid, "object": "stream", "status": "in_progress"})
    st = server_state(request)
    spawn(request, req, entry, _run_resumable, request, req, replier, entry, st.config.resume_grace_seconds)
    return sse(entry.follow())


async def _run_resumable(request: Request, req: GenerationRequest, replier: Any, entry: StoredResponse,
                         grace: float) -> None:
    ended = False
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_cancel_when_unwatched, entry, grace)
            ended = await pump(entry, detached(request, req, replier))
            tg.cancel_scope.cancel()
    finally:
        entry.update({**entry.snapshot, "status": "completed" if ended else "cancelled"})


async def _cancel_when_unwatched(entry: StoredResponse, grace: float) -> None:
    """Cancel the run once no client has followed it for `grace` seconds."""
    while True:
        idle = entry.unwatched_for()
        if idle is not None and idle >= grace:
            entry.scope.cancel()
            return
        with anyio.move_on_after(grace - (idle or 0.0)):
            await entry.changed()


def resume_point(request: Request, entry: StoredResponse) -> int:
    """The event number to resume after: `starting_after`, else the `Last-Event-ID` header (`N` or `ID/N`, as the
    events' SSE ids are written), else -1 (from the start)."""
    raw, name = request.query_params.get("starting_after"), "starting_after"
    if raw is None and request.headers.get("last-event-id") is not None:
        raw, name = request.headers["last-event-id"], "Last-Event-ID"
        owner, _, raw = raw.rpartition("/")
        if owner and owner != entry.id:
            raise bad_request(f"Last-Event-ID {owner}/{raw} names another stream than {entry.id}", name)
    if raw is None:
        return -1
    if not raw.isascii() or not raw.isdigit() or len(raw) > 12:
        raise bad_request(f"{name} must be an event's sequence number (an integer >= 0), got {raw!r}", name)
    return int(raw)


def resumed_post(request: Request) -> Response | None:
    """A client's reconnect that repeats its POST with `Last-Event-ID: ID/N`: the rest of stream ID (404 when it
    is unknown or expired); None for a POST that is not one."""
    value = request.headers.get("last-event-id")
    if value is None or "/" not in value:
        return None
    return _follow(request, value.rpartition("/")[0])


def _follow(request: Request, stream_id: str) -> Response:
    entry = server_state(request).responses.get(stream_id)
    if entry.snapshot.get("object") != "stream":
        raise bad_request(f"{stream_id} is not a resumable stream (a background response is read at "
                          "/v1/responses/{id})", "id")
    return sse(entry.follow(resume_point(request, entry)))


async def reattach(request: Request) -> Response:
    """GET /v1/chat/completions/{id} (or /v1/completions/{id}): a resumable stream's events after `starting_after`
    (or the `Last-Event-ID` header), then live until it ends."""
    return _follow(request, request.path_params["stream_id"])
