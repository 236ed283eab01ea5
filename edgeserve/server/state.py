"""Per-app state shared by the routes, the request-id context and the error-catching route wrapper."""

from __future__ import annotations

import contextvars
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from anyio.abc import TaskGroup
from starlette.requests import Request
from starlette.responses import Response

from edgeserve.server.config import ServerConfig
from edgeserve.server.disconnect import CLIENT_CLOSED, ClientGone
from edgeserve.server.errors import error_response
from edgeserve.server.metrics import Metrics
from edgeserve.server.live_requests import LiveRequests
from edgeserve.server.model_manager import ModelManager
from edgeserve.server.response_store import ResponseStore

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("edgeserve_request_id", default="-")


@dataclass
class ServerState:
    """What every route needs: the config, the model manager, the metrics, the stored background responses and
    the app's task group (for work that outlives its request; set while the app runs) and the running generations."""

    config: ServerConfig
    manager: ModelManager
    metrics: Metrics
    started: int = field(default_factory=lambda: int(time.time()))
    responses: ResponseStore = field(init=False)
    tasks: TaskGroup | None = None
    live: LiveRequests = field(default_factory=LiveRequests)  # running generations by request / reply id

    def __post_init__(self) -> None:
        self.responses = ResponseStore(self.config.max_stored_responses, self.config.stored_response_seconds)


def server_state(request: Request) -> ServerState:
    """The app's ServerState."""
    return request.app.state.server


def api_errors(fn: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """Turn any exception of a route into the error response for its API (never a traceback to the client)."""

    @functools.wraps(fn)
    async def wrapper(request: Request) -> Response:
        try:
            return await fn(request)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)  # nobody reads it
        except Exception as e:
            return error_response(request, e)

    return wrapper


class RequestIdFilter(logging.Filter):
    """Adds `request_id` (the current request's id, or '-') to every log record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


def configure_logging(level: str = "info") -> None:
    """Log lines as `time level [request id] message` on stderr."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [%(request_id)s] %(name)s: %(message)s"))
    logger = logging.getLogger("edgeserve")
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False
