"""ClusterIngress: the cluster's one HTTP app; checks the key and size limit, routes each request to a replica by
its prefix (route_key + PrefixAffinityRouter), streams the answer back, and merges per-replica routes."""

from __future__ import annotations

import json
import logging
from typing import Any

import anyio
from ray.exceptions import RayActorError
from starlette.types import Receive, Scope, Send

from edgeserve.cluster.aggregate import merge_health, merge_metrics, merge_ps
from edgeserve.cluster.owners import ReplicaOwners, addressed_id, request_id
from edgeserve.cluster.route_key import route_key
from edgeserve.cluster.wire import ForwardedRequest, ResponseStart
from edgeserve.server.auth import authorized, needs_key
from edgeserve.server.config import ServerConfig
from edgeserve.server.errors import APIError, error_body

log = logging.getLogger("edgeserve.cluster")
RETRIES = 3  # tries of a request whose replica died before answering (the router drops a dead replica at once)
REPLICA_CALL_TIMEOUT = 30.0  # seconds for one replica's /metrics, /api/ps or /health


class _TooLarge(Exception):
    pass


class ClusterIngress:
    """The ASGI app of `edgeserve cluster`, over the replicas' DeploymentHandle."""

    def __init__(self, handle: Any, config: ServerConfig) -> None:
        self.handle = handle.options(stream=True)  # one handle, so one router (and one affinity table) for all
        self.config = config
        self.local = {"/metrics": self._metrics, "/api/ps": self._ps, "/health": self._health}
        self.owners = ReplicaOwners()  # which replica answered which request (what it stored stays there)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (msg := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        path = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.config.api_key and needs_key(path) and not authorized(headers, self.config.api_key):
            msg = "missing or invalid API key: send `Authorization: Bearer KEY` or `x-api-key: KEY`"
            await _send_error(send, path, APIError(401, msg, code="invalid_api_key",
                                                   headers={"www-authenticate": "Bearer"}))
            return
        try:
            body = await self._read_body(headers, receive)
        except _TooLarge:
            msg = f"request body is larger than the limit of {self.config.max_body_bytes} bytes"
            await _send_error(send, path, APIError(413, msg, code="request_too_large"))
            return
        rid = request_id(headers.get("x-request-id"))
        addressed = addressed_id(path, headers.get("last-event-id"))
        req = ForwardedRequest(scope["method"], path, scope.get("query_string", b""),
                               (*((k, v) for k, v in scope["headers"] if k.lower() != b"x-request-id"),
                                (b"x-request-id", rid.encode())),
                               body, route_key(path, body), self.owners.owner_of(addressed) if addressed else None)
        if scope["method"] == "GET" and path in self.local:
            status, data, ctype = await self.local[path](req)
            await _send_whole(send, status, data, ctype)
            return
        await self._stream(req, rid, receive, send)

    async def _read_body(self, headers: dict[str, str], receive: Receive) -> bytes:
        limit = self.config.max_body_bytes
        if headers.get("content-length", "").isdigit() and int(headers["content-length"]) > limit:
            raise _TooLarge
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                break
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                raise _TooLarge
            more = msg.get("more_body", False)
        return b"".join(chunks)

    async def _stream(self, req: ForwardedRequest, rid: str, receive: Receive, send: Send) -> None:
        """Forward `req` and stream the reply; a client that goes away cancels it on the replica."""
        async with anyio.create_task_group() as tg:
            async def watch_disconnect() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(watch_disconnect)
            await self._forward(req, rid, send)
            tg.cancel_scope.cancel()

    async def _forward(self, req: ForwardedRequest, rid: str, send: Send) -> None:
        """Stream `req`'s reply from a replica (another one when it dies before answering), remembering which
        replica answered request `rid`."""
        for attempt in range(RETRIES):
            started = False
            gen = self.handle.forward.remote(req)
            try:
                async for item in gen:
                    if isinstance(item, ResponseStart):
                        started = True
                        self.owners.answered(rid, item.replica)
                        hdrs = [*item.headers, (b"x-edgeserve-replica", item.replica.encode())]
                        await send({"type": "http.response.start", "status": item.status, "headers": hdrs})
                    else:
                        await send({"type": "http.response.body", "body": item, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            except RayActorError as e:  # the replica died: another one takes the request if nothing was sent
                if started or attempt == RETRIES - 1:
                    return await _fail(send, req.path, started, f"the replica serving the request died: {e}")
                log.warning("replica died before answering %s; retrying on another", req.path)
            except anyio.get_cancelled_exc_class():
                gen.cancel()
                raise
            except Exception as e:
                return await _fail(send, req.path, started, f"replica error: {type(e).__name__}: {e}")

    async def _each_replica(self, req: ForwardedRequest) -> dict[str, tuple[int, bytes] | None]:
        """`req` sent to every live replica at once, by replica id; a replica that failed to answer is left out."""
        plain = ForwardedRequest(req.method, req.path, req.query_string, req.headers, b"")
        results = await self.handle.broadcast("call", plain).results_async(timeout_s=REPLICA_CALL_TIMEOUT,
                                                                           return_exceptions=True)
        out = {}
        for r in results:
            if isinstance(r, BaseException):
                log.warning("a replica did not answer %s: %s", req.path, r)
            else:
                out[r[0]] = (r[1], r[2])
        return dict(sorted(out.items()))

    async def _metrics(self, req: ForwardedRequest) -> tuple[int, bytes, bytes]:
        answers = await self._each_replica(req)
        text = merge_metrics({r: a[1].decode() for r, a in answers.items() if a and a[0] == 200})
        return 200, text.encode(), b"text/plain; version=0.0.4; charset=utf-8"

    async def _ps(self, req: ForwardedRequest) -> tuple[int, bytes, bytes]:
        answers = await self._each_replica(req)
        merged = merge_ps({r: json.loads(a[1]) for r, a in answers.items() if a and a[0] == 200})
        return 200, json.dumps(merged).encode(), b"application/json"

    async def _health(self, req: ForwardedRequest) -> tuple[int, bytes, bytes]:
        answers = await self._each_replica(req)
        status, body = merge_health({r: json.loads(a[1]) if a and a[0] == 200 else None for r, a in answers.items()})
        return status, json.dumps(body).encode(), b"application/json"


async def _send_whole(send: Send, status: int, data: bytes, ctype: bytes,
                      extra: list[tuple[bytes, bytes]] | None = None) -> None:
    hdrs = [(b"content-type", ctype), (b"content-length", str(len(data)).encode()), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": data})


async def _send_error(send: Send, path: str, err: APIError) -> None:
    extra = [(k.encode(), v.encode()) for k, v in err.headers.items()]
    await _send_whole(send, err.status, json.dumps(error_body(path, err)).encode(), b"application/json", extra)


async def _fail(send: Send, path: str, started: bool, message: str) -> None:
    """A replica failure: a 502 in the route's API shape, or (mid-stream) the end of the stream."""
    log.warning("%s: %s", path, message)
    if started:
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    else:
        await _send_error(send, path, APIError(502, message, "server_error", code="replica_failed"))
