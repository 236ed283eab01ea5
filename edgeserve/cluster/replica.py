"""EdgeserveReplica: one edgeserve server (create_app) inside a Ray Serve replica, fed ForwardedRequests."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from ray import serve

from edgeserve.cluster.wire import ForwardedRequest, ResponseStart
from edgeserve.server.config import ServerConfig


class EdgeserveReplica:
    """The whole edgeserve app (routes, model manager with lazy load and keep_alive, metrics) of one replica.

    Its lifespan (the model manager's task group) runs for the replica's life on the replica's event loop.
    """

    async def __init__(self, config: ServerConfig) -> None:
        from edgeserve.server import create_app
        from edgeserve.server.state import configure_logging

        configure_logging(config.log_level)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.app = create_app(config)
        self._started, self._stop = asyncio.Event(), asyncio.Event()
        self._lifespan = asyncio.create_task(self._run_lifespan())
        await self._started.wait()

    async def _run_lifespan(self) -> None:
        async with self.app.router.lifespan_context(self.app):
            self._started.set()
            await self._stop.wait()

    async def forward(self, req: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """Run one request through the app: a ResponseStart, then the body as it is written (SSE flushes per
        chunk). Stopping the iteration (the client went away) cancels the request in the engine."""
        queue: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        sent = [False]

        async def receive() -> dict:
            if not sent[0]:
                sent[0] = True
                return {"type": "http.request", "body": req.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def run() -> None:
            try:
                await self.app(_scope(req), receive, queue.put)
            finally:
                queue.put_nowait(None)

        task = asyncio.create_task(run())
        try:
            while (msg := await queue.get()) is not None:
                if msg["type"] == "http.response.start":
                    yield ResponseStart(self.replica_id, msg["status"], tuple(msg.get("headers", ())))
                elif msg["type"] == "http.response.body" and msg.get("body"):
                    yield bytes(msg["body"])
            await task  # an exception of the app reaches the ingress
        finally:
            gone.set()
            if not task.done():
                task.cancel()

    async def call(self, req: ForwardedRequest) -> tuple[str, int, bytes]:
        """One whole reply (the ingress's per-replica /metrics, /api/ps, /health): (replica id, status, body)."""
        status, chunks = 500, []
        async for item in self.forward(req):
            if isinstance(item, ResponseStart):
                status = item.status
            else:
                chunks.append(item)
        return self.replica_id, status, b"".join(chunks)

    async def __del__(self) -> None:
        """Replica shutdown: the lifespan ends, which unloads the models."""
        self._stop.set()
        await self._lifespan


def _scope(req: ForwardedRequest) -> dict:
    """The ASGI HTTP scope of a forwarded request."""
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": req.method, "scheme": "http", "path": req.path, "raw_path": req.path.encode(),
            "query_string": req.query_string, "root_path": "", "headers": list(req.headers),
            "client": ("ray-ingress", 0), "server": ("edgeserve-replica", 0)}
