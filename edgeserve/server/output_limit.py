"""The server's output-token default and maximum (`--default-max-tokens`, `--max-tokens-limit`): what a request
that sets no output limit, or a larger one than allowed, generates at most."""

from __future__ import annotations

from typing import Any

from edgeserve.server.config import ServerConfig


def output_tokens(requested: int | None, config: ServerConfig) -> int | None:
    """The output-token limit a request runs with: its own (`max_tokens`, `num_predict`, `max_output_tokens`), else
    the server's default, either capped at the server's maximum; None: up to the end of the context."""
    limit = requested if requested is not None else config.default_max_tokens
    if config.max_tokens_limit is not None:
        limit = config.max_tokens_limit if limit is None else min(limit, config.max_tokens_limit)
    return limit


def output_token_settings(config: ServerConfig) -> dict[str, Any]:
    """The two settings as /api/show reports them (None: up to the end of the context)."""
    return {"default_max_tokens": output_tokens(None, config), "max_tokens_limit": config.max_tokens_limit}


def ollama_parameter_lines(config: ServerConfig) -> list[str]:
    """Lines for Ollama's `parameters` text: `num_predict N`, the output tokens of a request that sets none."""
    default = output_tokens(None, config)
    return [] if default is None else [f"num_predict {default}"]
