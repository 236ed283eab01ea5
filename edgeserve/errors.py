"""Errors that users see as one clear line (CLI) or a 4xx body (HTTP)."""


class EdgeserveError(Exception):
    """Base class: the message is meant for the user as it is."""


class ModelLoadError(EdgeserveError):
    """A model file or folder is missing, truncated, corrupt or incomplete."""


class UnsupportedModelError(EdgeserveError):
    """The model uses an architecture or quantization type edgeserve does not support."""


class UnknownModelError(EdgeserveError):
    """A model name is neither in the catalog nor a local path."""


class PullError(EdgeserveError):
    """Fetching a catalog model failed (network, pip, checksum)."""


class ChatTemplateError(EdgeserveError):
    """A chat template failed to compile or render (bad message order, unsafe access, template bug)."""


class QueueFullError(EdgeserveError):
    """The engine's waiting queue is full (HTTP 429)."""

    def __init__(self, message: str = "busy") -> None:
        super().__init__(message)


class PromptTooLongError(EdgeserveError, ValueError):
    """The prompt leaves no room in the model's context for even one new token (HTTP 400)."""


class EngineError(EdgeserveError):
    """The engine failed while running a step; the requests in flight were ended."""
