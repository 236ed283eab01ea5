"""A model's recommended sampling: the values its file suggests (GGUF `general.sampling.*`, as llama.cpp's
converter writes them; a Hugging Face folder's generation_config.json, as vLLM reads it), in SamplingParams names.

The server uses them as the defaults of every API for that model: a request's own value always wins. A value
outside the range a request may give is left out (the server's default applies to it)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

# GGUF general.sampling.<key> -> SamplingParams field (mirostat and xtc: samplers this server does not have)
GGUF_KEYS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
             "penalty_repeat": "repetition_penalty", "penalty_last_n": "penalty_last_n"}
# generation_config.json key -> SamplingParams field
HF_KEYS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty"}
# SamplingParams field -> Ollama's option name, for /api/show's `parameters`
OLLAMA_NAMES = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                "repetition_penalty": "repeat_penalty", "penalty_last_n": "repeat_last_n"}


def from_gguf(metadata: dict[str, Any]) -> dict[str, Any]:
    """The recommended sampling in a GGUF's metadata (empty when it has none)."""
    return _checked({field: metadata.get(f"general.sampling.{key}") for key, field in GGUF_KEYS.items()})


def from_generation_config(folder: Path) -> dict[str, Any]:
    """The recommended sampling in `folder`/generation_config.json (empty when there is none)."""
    try:
        cfg = json.loads((folder / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(cfg, dict):
        return {}
    return _checked({field: cfg.get(key) for key, field in HF_KEYS.items()})


def _checked(values: dict[str, Any]) -> dict[str, Any]:
    """The values that are numbers a request could give for their field (integers where the field wants one)."""
    from edgeserve.server.fields import RANGES

    out: dict[str, Any] = {}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        rng = RANGES[name]
        if rng.integer:
            if float(value) != int(value):
                continue
            value = int(value)
        else:
            value = float(value)
        if rng.contains(value):
            out[name] = value
    return out


def ollama_lines(sampling: dict[str, Any]) -> list[str]:
    """`name value` lines of Ollama's `parameters` text for the recommended sampling."""
    return [f"{OLLAMA_NAMES[k]} {round(v, 6) if isinstance(v, float) else v}" for k, v in sampling.items()]
