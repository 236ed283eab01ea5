"""create_app(config): the Starlette app, its middleware and its lifespan (one anyio task group)."""

from __future__ import annotations

import json
import re
import uuid
from contextlib import asynccontextmanager
from importlib import resources
from typing import AsyncIterator

import anyio
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from edgeserve.server.api import (adapter_routes, anthropic, embeddings, ollama, ollama_create, ollama_models, openai,
                                  rerank, responses, thinking_routes)
from edgeserve.server.auth import authorized, needs_key
from edgeserve.server.config import ServerConfig
from edgeserve.server.errors import APIError, BodyTooLargeError, error_body, error_response, from_exception
from edgeserve.server.metrics import Metrics
from edgeserve.server.model_manager import ModelManager
from edgeserve.server.state import ServerState, request_id_var, server_state

_RID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


async def health(request: Request) -> Response:
    """GET /health: 200 while serving, with every configured model's state (not loaded / loading / loaded)."""
    st = server_state(request)
    models = {mid: "not loaded" for mid in st.manager.configured}
    models.update({e.id: e.state for e in st.manager.entries.values()})
    return JSONResponse({"status": "ok", "loading": any(s == "loading" for s in models.values()), "models": models})


async def metrics(request: Request) -> Response:
    """GET /metrics: Prometheus text."""
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


# The page loads only its own files; model output can never run script or load remote images, even past DOMPurify.
CHAT_PAGE_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
                 "object-src 'none'; base-uri 'none'; frame-ancestors 'none'")


async def chat_page(request: Request) -> Response:
    """GET /: the built-in chat page (its script, styles and vendored libraries are under /static/)."""
    html = resources.files("edgeserve.server").joinpath("static/chat.html").read_text(encoding="utf-8")
    return HTMLResponse(html, headers={"content-security-policy": CHAT_PAGE_CSP})


BLOB_PATH = "/api/blobs/"


def _too_large(limit: int) -> str:
    return f"request body is larger than the limit of {limit} bytes ({limit / 2 ** 20:g} MiB)"


class ServerMiddleware:
    """Request ids (X-Request-Id in and out, in every log line), the API key, the body size limit, status counts."""

    def __init__(self, app: ASGIApp, state: ServerState, paths: set[str]) -> None:
        self.app, self.state, self.paths = app, state, paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        rid = headers.get("x-request-id", "")
        rid = rid if _RID.match(rid) else uuid.uuid4().hex[:16]
        token = request_id_var.set(rid)
        scope.setdefault("state", {})["request_id"] = rid
        path = scope["path"]
        status = [500]
        started = [False]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                started[0] = True
                status[0] = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        cfg = self.state.config
        try:
            if cfg.api_key and needs_key(path) and not authorized(headers, cfg.api_key):
                msg = "missing or invalid API key: send `Authorization: Bearer KEY` or `x-api-key: KEY`"
                await self._reply(scope, send_with_id, 401, msg, "invalid_api_key", {"www-authenticate": "Bearer"})
                return
            # a blob streams to disk (server/blobs.py) under its own limit; every other body is read whole
            limit = cfg.max_blob_bytes if path.startswith(BLOB_PATH) else cfg.max_body_bytes
            length = headers.get("content-length", "")
            if length.isdigit() and int(length) > limit:
                await self._reply(scope, send_with_id, 413, _too_large(limit), "request_too_large", {})
                return
            received = [0]

            async def limited_receive() -> Message:
                message = await receive()
                if message["type"] == "http.request":
                    received[0] += len(message.get("body", b""))
                    if received[0] > limit:
                        raise BodyTooLargeError(_too_large(limit))
                return message

            try:
                await self.app(scope, limited_receive, send_with_id)
            except Exception as e:
                if started[0]:  # nothing can be said in-band any more; the server logs it
                    raise
                # any route that failed outside its own error handling still answers in its API's shape
                err = from_exception(e, rid)
                await self._send_error(scope, send_with_id, err)
        finally:
            label = path if path in self.paths else "other"
            self.state.metrics.requests.labels(label, str(status[0])).inc()
            request_id_var.reset(token)

    async def _reply(self, scope: Scope, send: Send, status: int, message: str, code: str,
                     headers: dict[str, str]) -> None:
        await self._send_error(scope, send, APIError(status, message, "invalid_request_error", None, code, headers))

    @staticmethod
    async def _send_error(scope: Scope, send: Send, err: APIError) -> None:
        data = json.dumps(error_body(scope["path"], err)).encode()
        hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        hdrs += [(k.encode(), v.encode()) for k, v in err.headers.items()]
        await send({"type": "http.response.start", "status": err.status, "headers": hdrs})
        await send({"type": "http.response.body", "body": data})


def create_app(config: ServerConfig | None = None) -> Starlette:
    """The server as an ASGI app: routes, middleware, and a lifespan that runs the model manager's task group."""
    config = config or ServerConfig()
    manager = ModelManager(config)
    state = ServerState(config, manager, Metrics(manager))
    manager._on_loaded = state.metrics.observe_load

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            tg.start_soon(manager.run, tg)
            state.tasks = tg
            yield
            manager.stop_engines()  # work in flight stops at its next step or sub-batch, not at its end
            tg.cancel_scope.cancel()

    routes = [
        Route("/", chat_page, methods=["GET"]),
        Mount("/static", StaticFiles(packages=[("edgeserve.server", "static")]), name="static"),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *openai.ROUTES,
        *ollama_models.ROUTES,
        *ollama.ROUTES,
        *embeddings.ROUTES,
        *rerank.ROUTES,
        *anthropic.ROUTES,
        *responses.ROUTES,
        *thinking_routes.ROUTES,
        *adapter_routes.ROUTES,
        *ollama_create.ROUTES,
    ]
    async def http_error(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        detail = getattr(exc, "detail", "") or "error"
        return error_response(request, APIError(status, f"{request.method} {request.url.path}: {detail}",
                                                "invalid_request_error", None, "not_found" if status == 404 else None,
                                                dict(getattr(exc, "headers", None) or {})))

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.server = state
    app.add_middleware(ServerMiddleware, state=state, paths={r.path for r in routes})
    return app
