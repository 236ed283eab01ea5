"""The registry of reply formats: one module per family's tool-call / reasoning format (edgeserve.text.formats.base
says what a format declares). `detect_format` picks a template's format; `get_format` looks one up by name
(`--tool-format NAME`).

Adding a format: a module here that defines `FORMATS = (ChatFormat(...), ...)`, its name in `MODULES`, and a
test data file.
"""

from __future__ import annotations

import importlib
from functools import lru_cache

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall

__all__ = ["CallContext", "ChatFormat", "ToolCall", "MODULES", "all_formats", "detect_format", "get_format"]

# the modules of edgeserve.text.formats that define formats (each a FORMATS tuple); the fallback is "hermes"
MODULES: tuple[str, ...] = (
    "lfm2", "mistral3", "cohere", "functionary", "granite", "apertus", "apriel", "gigachat", "minicpm5", "hunyuan",
    "solar_open", "deepseek", "deepseek_dsml", "glm", "kimi", "minimax", "seed_oss", "nemotron", "muse_glimmer",
    "gemma4", "qwen3_coder", "mistral", "llama3", "hermes",
)
FALLBACK = "hermes"


@lru_cache(maxsize=1)
def all_formats() -> tuple[ChatFormat, ...]:
    """Every registered format, in detection order (priority, then registration order)."""
    found: list[ChatFormat] = []
    for name in MODULES:
        found.extend(importlib.import_module(f"{__name__}.{name}").FORMATS)
    return tuple(sorted(found, key=lambda f: f.priority))


def get_format(name: str) -> ChatFormat:
    """The format called `name`; ValueError naming the known ones otherwise."""
    for fmt in all_formats():
        if fmt.name == name:
            return fmt
    raise ValueError(f"unknown tool format {name!r}; known: {', '.join(sorted(f.name for f in all_formats()))}")


def detect_format(template_source: str) -> ChatFormat:
    """The format a chat template writes: the first registered format whose `detect` accepts it, else hermes."""
    for fmt in all_formats():
        if fmt.detect(template_source):
            return fmt
    return get_format(FALLBACK)
