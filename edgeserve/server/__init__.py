"""The HTTP server: OpenAI- and Ollama-compatible routes over the AsyncEngine, with lazy model loading."""

from edgeserve.server.app import create_app
from edgeserve.server.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]
