"""The one request pipeline behind every generation route.

An API adapter (edgeserve/server/api/) parses its body into a `GenerationRequest` and hands it here with a
`Replier`: the object that knows its API's shapes. The pipeline does the rest, once for every API:

- a streamed request for a model not loaded yet gets its headers at once and the replier's `ping` item while the
  model loads (clients with a short first-byte timeout keep waiting); load errors then come in-band;
- the model is leased, the prompt rendered and the grammar compiled off the event loop (`Generation.prepare`),
  and the engine requests submitted; errors before the response starts are raised (the route answers them in its
  API's error shape);
- streamed: the replier turns the events into its API's items (SSE events or NDJSON lines); an error after the
  response started comes in-band as `replier.error(err)`; the engine requests are cancelled when the client leaves;
- not streamed: the choices are collected (a client that leaves cancels them, and gets 499) and the replier
  builds the JSON body.

The events an adapter reads are `Event`s from `Generation.outputs()` (below); the whole request's
`Generation.usage`, `first_token_at`, `arrived` and `load_ns` give usage and timings.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Protocol

import anyio.to_thread
from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from edgeserve.engine.outputs import RequestOutput
from edgeserve.server.adapters import pick_adapter
from edgeserve.server.disconnect import CLIENT_CLOSED, ClientGone, unless_disconnected
from edgeserve.server.errors import APIError, from_exception
from edgeserve.server.generation import ChoiceResult, Generation
from edgeserve.server.loading import acquire_with_pings, is_loaded
from edgeserve.server.model_manager import Lease
from edgeserve.server.request import GenerationRequest
from edgeserve.server.state import server_state

NDJSON = "application/x-ndjson"

# The pipeline's events, as a replier reads them from `Generation.outputs()`: (choice index, delta). The delta's
# `text` is content, `reasoning` the reasoning, `tool_calls` the parsed calls (on a choice's last delta, whose
# `finish_reason` is set: "stop", "length", "tool_calls" or "abort"), `logprobs` one per new token when asked,
# and the token counts so far; `Generation.collect()` sums them per choice into a `ChoiceResult`.
Event = tuple[int, RequestOutput]


class Replier(Protocol):
    """What an API adapter gives the pipeline: its field names and its reply shapes."""

    prompt_param: str  # the request field a too-long prompt names
    constraint_param: str  # the field a bad grammar (response format) names
    ndjson: bool  # streamed as NDJSON lines (Ollama) rather than SSE
    ping: Any  # the item sent every second while the model loads (None: nothing)

    def body(self, gen: Generation, results: list[ChoiceResult]) -> dict:
        """The JSON reply of a request that is not streamed."""

    def stream(self, gen: Generation) -> AsyncIterator[Any]:
        """The items of a streamed reply (SSE dicts or NDJSON lines), from `gen.outputs()`."""

    def error(self, err: APIError) -> Any:
        """An error after the response started, as one item of the stream."""


async def respond(request: Request, req: GenerationRequest, replier: Replier) -> Response:
    """Run `req` and answer it in the replier's API shape (JSON, SSE or NDJSON)."""
    arrived = time.monotonic()
    st = server_state(request)
    pick_adapter(st.manager, req)
    if req.stream and not is_loaded(st.manager, req.model):
        return _streaming(replier, _after_load(request, req, replier, arrived))
    lease = await st.manager.acquire(req.model, req.keep_alive)
    try:  # a client that leaves while its prompt is prepared (images encoded) stops that work too
        gen = await unless_disconnected(request, start(request, req, replier, lease, arrived))
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    if req.stream:
        # close() also runs if the body is never iterated (the client left before the response started)
        return _streaming(replier, _guarded(gen, replier), BackgroundTask(gen.aclose))
    results = await gen.collect_unless_disconnected(request)
    if results is None:
        return Response(status_code=CLIENT_CLOSED)  # the client is gone; nothing is sent
    return JSONResponse(replier.body(gen, results))


async def start(request: Request, req: GenerationRequest, replier: Replier, lease: Lease,
                arrived: float) -> Generation:
    """Set up the request on its leased model (template, tools, grammar compiled: 400s come here) and submit it."""
    st = server_state(request)
    gen = Generation(lease, req, st.metrics, request.state.request_id, replier.prompt_param)
    gen.constraint_param = replier.constraint_param
    gen.arrived, gen.load_ns = arrived, int((time.monotonic() - arrived) * 1e9)
    try:
        await gen.prepare()
        gen.submit()
    except BaseException:  # an error, or the client left (cancelled): the model's lease goes back
        gen.close()
        raise
    reply_id = getattr(replier, "rid", None) or getattr(replier, "mid", None)  # the id its reply carries
    st.live.add(gen, {request.state.request_id} | ({reply_id} if reply_id else set()))
    return gen


async def prompt_tokens(request: Request, req: GenerationRequest, prompt_param: str) -> int:
    """The token count of `req`'s (first) prompt through the model's chat template, nothing generated."""
    st = server_state(request)
    pick_adapter(st.manager, req)
    lease = await st.manager.acquire(req.model)
    try:
        gen = Generation(lease, req, st.metrics, request.state.request_id, prompt_param)
        if getattr(lease.engine, "is_embedding", False):
            raise APIError(400, f"model {lease.entry.id!r} is an embedding model", "invalid_request_error", "model")
        await gen.check_size()
        return len((await anyio.to_thread.run_sync(gen.prompt_ids))[0])
    finally:
        lease.release()


def _streaming(replier: Replier, items: AsyncIterator[Any], background: BackgroundTask | None = None) -> Response:
    if replier.ndjson:
        return StreamingResponse(items, media_type=NDJSON, background=background)
    return EventSourceResponse(items, ping=15, send_timeout=30, background=background)


async def _guarded(gen: Generation, replier: Replier) -> AsyncIterator[Any]:
    """The replier's stream; an error ends it in-band, and the engine requests are cancelled whatever happens."""
    try:
        async for item in replier.stream(gen):
            yield item
    except Exception as e:  # after the response started: report in-band, then end the stream
        yield replier.error(from_exception(e, gen.request_id))
    finally:
        gen.close()


async def detached(request: Request, req: GenerationRequest, replier: Replier) -> AsyncIterator[Any]:
    """The replier's stream of `req` for a run that outlives its request (background responses; `pick_adapter`
    already applied): the model is leased first (loaded if need be), and every error comes in-band."""
    arrived = time.monotonic()
    st = server_state(request)
    try:
        lease = await st.manager.acquire(req.model, req.keep_alive)
        gen = await start(request, req, replier, lease, arrived)
    except Exception as e:
        yield replier.error(from_exception(e, request.state.request_id))
        return
    async for item in _guarded(gen, replier):
        yield item


async def _after_load(request: Request, req: GenerationRequest, replier: Replier,
                      arrived: float) -> AsyncIterator[Any]:
    """A streamed body for a model not loaded yet: `replier.ping` items while it loads, then the stream. Errors
    before the first event (the load failed, the prompt is too long) come in-band: the headers are sent."""
    st = server_state(request)
    gen = None
    try:
        async for lease in acquire_with_pings(st.manager, req.model, req.keep_alive):
            if lease is None:
                if replier.ping is not None:
                    yield replier.ping
                continue
            gen = await start(request, req, replier, lease, arrived)
    except Exception as e:
        yield replier.error(from_exception(e, request.state.request_id))
        return
    assert gen is not None
    async for item in _guarded(gen, replier):
        yield item


# No keep-alive comments on these streams: their events carry SSE ids, and after an id the openai client reads a
# comment's blank line as an event with empty data (it fails to parse it). A client whose connection idles out
# reattaches instead. (A day, not 0: 0 means "no pings" only in recent sse-starlette versions.)
NO_PING = 86400


def sse(events: AsyncIterator[dict]) -> Response:
    """A stored run's events as an SSE response."""
    return EventSourceResponse(events, ping=NO_PING, send_timeout=30)
