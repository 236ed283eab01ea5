"""HTTP errors: OpenAI-shaped bodies ({"error": {message, type, param, code}}) and exception -> status mapping."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import JSONResponse

from edgeserve.errors import (ChatTemplateError, EdgeserveError, InvalidRequestError, ModelLoadError, QueueFullError,
                              UnknownModelError, UnsupportedModelError)

log = logging.getLogger("edgeserve.server")


@dataclass
class APIError(Exception):
    """An error the client gets as it is: status, message, and the OpenAI error fields."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message


class BodyTooLargeError(Exception):
    """The request body passed the server's size limit (HTTP 413)."""


class InsufficientMemoryError(EdgeserveError):
    """A model would not fit in free memory (HTTP 507); the message carries the estimate."""


class ModelsBusyError(EdgeserveError):
    """--max-loaded-models models are loaded and none is idle, so no other can load now (HTTP 503)."""


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 naming the offending field."""
    return APIError(400, message, "invalid_request_error", param, code)


def model_not_supported(model_id: str, why: str) -> APIError:
    """A 400 on the `model` field: model `model_id` cannot serve this endpoint (`why` follows its name)."""
    return bad_request(f"model {model_id!r} {why}", "model", "model_not_supported")


def from_exception(exc: BaseException, request_id: str = "") -> APIError:
    """Map any exception raised while handling a request to the APIError the client sees."""
    from edgeserve.engine.async_engine import PromptTooLongError

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:  # raised through a task group
        return from_exception(exc.exceptions[0], request_id)
    if isinstance(exc, BodyTooLargeError):
        return APIError(413, str(exc), "invalid_request_error", None, "request_too_large")
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), "invalid_request_error", "messages", "context_length_exceeded")
    if isinstance(exc, QueueFullError):
        return APIError(429, f"server busy: the request queue is full ({exc}); retry shortly", "rate_limit_error",
                        None, "queue_full", {"Retry-After": "1"})
    if isinstance(exc, UnknownModelError):
        return APIError(404, str(exc), "invalid_request_error", "model", "model_not_found")
    if isinstance(exc, InsufficientMemoryError):
        return APIError(507, str(exc), "server_error", "model", "insufficient_memory")
    if isinstance(exc, ModelsBusyError):
        return APIError(503, str(exc), "server_error", "model", "models_busy", {"Retry-After": "5"})
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), "invalid_request_error", exc.param)
    if isinstance(exc, ChatTemplateError):
        return APIError(400, f"chat template: {exc}", "invalid_request_error", "messages", "chat_template_error")
    if isinstance(exc, (ModelLoadError, UnsupportedModelError)):
        return APIError(500, f"model failed to load: {exc}", "server_error", "model", "model_load_error")
    if isinstance(exc, ValueError):  # SamplingParams and the engine name the field first
        from dataclasses import fields

        from edgeserve.sampling_params import SamplingParams

        param = str(exc).split(" ", 1)[0]
        param = param if param in {f.name for f in fields(SamplingParams)} else None
        return APIError(400, str(exc), "invalid_request_error", param)
    if isinstance(exc, EdgeserveError):
        return APIError(500, str(exc), "server_error")
    log.error("unexpected error", exc_info=exc)
    return APIError(500, f"internal server error ({type(exc).__name__}); request id {request_id}", "server_error",
                    None, "internal_error")


ANTHROPIC_PATHS = ("/v1/messages",)  # routes that answer errors in Anthropic's shape
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(err: APIError) -> dict:
    """The error in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
    kind = _ANTHROPIC_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    # the shape has no `param`: the message names the field instead
    message = err.message if not err.param or err.param in err.message else f"{err.param}: {err.message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body(path: str, err: APIError) -> dict:
    """The error body in the shape of the API `path` belongs to (Ollama, Anthropic or OpenAI)."""
    if path.startswith("/api/"):
        return {"error": err.message}
    if path.startswith(ANTHROPIC_PATHS):
        return anthropic_error_body(err)
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def error_response(request: Request, exc: BaseException) -> JSONResponse:
    """The error response for `exc`, shaped for the API the request path belongs to."""
    err = from_exception(exc, getattr(request.state, "request_id", ""))
    if err.status >= 500:
        log.warning("%s %s -> %d: %s", request.method, request.url.path, err.status, err.message)
    else:
        log.info("%s %s -> %d: %s", request.method, request.url.path, err.status, err.message)
    return JSONResponse(error_body(request.url.path, err), status_code=err.status, headers=err.headers)
