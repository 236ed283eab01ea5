"""The HTTP server: OpenAI- and Ollama-compatible routes over the AsyncEngine, with lazy model loading.

`create_app` loads on first use, so that `ServerConfig` (which the CLI checks its flags with) does not import the
routes, the engine and torch.
"""

from typing import TYPE_CHECKING

from edgeserve.server.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]

if TYPE_CHECKING:
    from edgeserve.server.app import create_app


def __getattr__(name: str):
    if name == "create_app":
        from edgeserve.server.app import create_app

        return create_app
    raise AttributeError(f"module 'edgeserve.server' has no attribute {name!r}")
