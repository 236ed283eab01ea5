"""OpenAI Responses background mode: `background: true` answers at once (status queued; or, with `stream: true`,
the stream, which a disconnect no longer stops) and the response runs on in the app's task group, stored in
memory (server/response_store.py). Routes:

- GET /v1/responses/{id}: the response object as of now (queued, in_progress, then its final status);
- GET /v1/responses/{id}?stream=true[&starting_after=N]: its events, replayed from the start or from after event
  N (a `Last-Event-ID: N` header does the same), then followed live until it finishes;
- POST /v1/responses/{id}/cancel: stops it (status cancelled; a finished one is returned as it is);
- DELETE /v1/responses/{id}: forgets it (cancelling it first).

An unknown, deleted or expired id is a 404 in OpenAI's error shape."""

from __future__ import annotations

from typing import Any

import anyio
from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edgeserve.server.adapters import pick_adapter
from edgeserve.server.errors import bad_request
from edgeserve.server.request import GenerationRequest
from edgeserve.server.respond import detached
from edgeserve.server.response_store import StoredResponse
from edgeserve.server.state import api_errors, server_state


def start_background(request: Request, req: GenerationRequest, replier: Any) -> Response:
    """Store the response as queued, start its run, and answer with it (or with its stream)."""
    st = server_state(request)
    pick_adapter(st.manager, req)
    st.manager.canonical(req.model)  # an unknown model is still a 404 now, not a failed response later
    if st.tasks is None:
        raise RuntimeError("the server's task group is not running")
    entry = StoredResponse(replier.rid, replier.snapshot("queued"))
    st.responses.add(entry)
    st.tasks.start_soon(_run, request, req, replier, entry)
    if req.stream:
        return _sse(entry.follow())
    return JSONResponse(entry.snapshot)


async def _run(request: Request, req: GenerationRequest, replier: Any, entry: StoredResponse) -> None:
    """Generate into `entry`: each event stored, the response object kept current; cancelled -> `cancelled`."""
    items = detached(request, req, replier)
    try:
        with entry.scope:
            async for item in items:
                entry.add(item)
                if replier.latest is not entry.snapshot and replier.latest is not None:
                    entry.update(replier.latest)
            if replier.failed is not None:  # the stream ended with an error event: the response failed
                entry.add(replier.event("response.failed", response=replier.snapshot("failed")))
                entry.update(replier.latest)
    finally:
        with anyio.CancelScope(shield=True):
            await items.aclose()  # the engine requests are aborted and the model's lease goes back
        if not entry.done:  # cancelled (by a client, or the server stopping)
            entry.update(replier.snapshot("cancelled"))


def _sse(events: Any) -> Response:
    return EventSourceResponse(events, ping=15, send_timeout=30)


def _flag(request: Request, name: str) -> bool:
    value = request.query_params.get(name, "false").lower()
    if value not in ("true", "false"):
        raise bad_request(f"{name} must be true or false", name)
    return value == "true"


def _starting_after(request: Request) -> int:
    """The event number to resume after: `starting_after`, else the `Last-Event-ID` header, else -1 (all)."""
    raw = request.query_params.get("starting_after")
    name = "starting_after"
    if raw is None and request.headers.get("last-event-id") is not None:
        raw, name = request.headers["last-event-id"], "Last-Event-ID"
    if raw is None:
        return -1
    if not raw.isascii() or not raw.isdigit() or len(raw) > 12:
        raise bad_request(f"{name} must be an event's sequence number (an integer >= 0), got {raw!r}", name)
    return int(raw)


@api_errors
async def retrieve(request: Request) -> Response:
    """GET /v1/responses/{response_id}: the response object, or (stream=true) its events after `starting_after`."""
    entry = server_state(request).responses.get(request.path_params["response_id"])
    stream = _flag(request, "stream")
    _flag(request, "include_obfuscation")  # accepted; nothing is obfuscated
    after = _starting_after(request)
    if not stream:
        if after >= 0:
            raise bad_request("starting_after is only allowed with stream=true", "starting_after")
        return JSONResponse(entry.snapshot)
    return _sse(entry.follow(after))


@api_errors
async def cancel(request: Request) -> Response:
    """POST /v1/responses/{response_id}/cancel: stop a running background response; its final object."""
    entry = server_state(request).responses.get(request.path_params["response_id"])
    entry.scope.cancel()
    await entry.finished()
    return JSONResponse(entry.snapshot)


@api_errors
async def delete(request: Request) -> Response:
    """DELETE /v1/responses/{response_id}: forget it (a running one is cancelled)."""
    entry = server_state(request).responses.remove(request.path_params["response_id"])
    return JSONResponse({"id": entry.id, "object": "response.deleted", "deleted": True})


ROUTES = [Route("/v1/responses/{response_id}", retrieve, methods=["GET"]),
          Route("/v1/responses/{response_id}", delete, methods=["DELETE"]),
          Route("/v1/responses/{response_id}/cancel", cancel, methods=["POST"])]
