"""OpenAI Responses background mode: `background: true` answers at once (status queued; or, with `stream: true`,
the stream, which a disconnect no longer stops) and the response runs on in the app's task group, stored in
memory (server/response_store.py). Routes:

- GET /v1/responses/{id}: the response object as of now (queued, in_progress, then its final status);
- GET /v1/responses/{id}?stream=true[&starting_after=N]: its events, replayed from the start or from after event
  N (a `Last-Event-ID: ID/N` or `N` header does the same), then followed live until it finishes;
- POST /v1/responses/{id}/cancel: stops it (status cancelled; a finished one is returned as it is);
- DELETE /v1/responses/{id}: forgets it (cancelling it first).

An unknown, deleted or expired id is a 404 in OpenAI's error shape."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edgeserve.server.detached_runs import pump, resume_point, spawn
from edgeserve.server.respond import sse
from edgeserve.server.errors import bad_request
from edgeserve.server.request import GenerationRequest
from edgeserve.server.respond import detached
from edgeserve.server.response_store import StoredResponse
from edgeserve.server.state import api_errors, server_state


def start_background(request: Request, req: GenerationRequest, replier: Any) -> Response:
    """Store the response as queued, start its run, and answer with it (or with its stream)."""
    entry = StoredResponse(replier.rid, replier.snapshot("queued"))
    spawn(request, req, entry, _run, request, req, replier, entry)
    # the stream's first event at once, with the id to resume by, even while the model loads
    entry.add(replier.event("response.created", response=entry.snapshot))
    replier.announced = True
    return sse(entry.follow()) if req.stream else JSONResponse(entry.snapshot)


async def _run(request: Request, req: GenerationRequest, replier: Any, entry: StoredResponse) -> None:
    """Generate into `entry`, keeping its response object current; an error ends it `failed`, a cancel
    `cancelled`."""
    def each(item: dict) -> None:
        if replier.latest is not None and replier.latest is not entry.snapshot:
            entry.update(replier.latest)

    try:
        if await pump(entry, detached(request, req, replier), each) and replier.failed is not None:
            entry.add(replier.event("response.failed", response=replier.snapshot("failed")))
            entry.update(replier.latest)
    finally:
        if not entry.done:  # cancelled (by a client, or the server stopping)
            entry.update(replier.snapshot("cancelled"))


def _flag(request: Request, name: str) -> bool:
    value = request.query_params.get(name, "false").lower()
    if value not in ("true", "false"):
        raise bad_request(f"{name} must be true or false", name)
    return value == "true"


@api_errors
async def retrieve(request: Request) -> Response:
    """GET /v1/responses/{response_id}: the response object, or (stream=true) its events after `starting_after`."""
    entry = server_state(request).responses.get(request.path_params["response_id"])
    stream = _flag(request, "stream")
    _flag(request, "include_obfuscation")  # accepted; nothing is obfuscated
    after = resume_point(request, entry)
    if not stream:
        if after >= 0:
            raise bad_request("starting_after is only allowed with stream=true", "starting_after")
        return JSONResponse(entry.snapshot)
    return sse(entry.follow(after))


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
