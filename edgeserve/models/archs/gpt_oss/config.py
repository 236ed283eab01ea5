"""gpt-oss's own ModelConfig fields: its per-layer windows and SwiGLU clamps."""

from __future__ import annotations

from typing import Any, Mapping

from edgeserve.models.config import ModelConfig


def _windows(window: int | None, sliding: list[bool]) -> dict[str, Any]:
    """`window` on the sliding layers, full attention on the others."""
    return dict(layer_windows=tuple(int(window) if s and window else None for s in sliding))


def fields_from_gguf(config: ModelConfig, metadata: Mapping[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """Its windows: llama.cpp slides the even layers (a pattern of 2, as HF's default layer_types)."""
    window = metadata.get(f"{config.architecture}.attention.sliding_window")
    return _windows(window, [i % 2 == 0 for i in range(config.num_layers)])


def fields_from_hf(config: ModelConfig, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Its windows (HF layer_types) and SwiGLU clamps."""
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    fields = _windows(cfg.get("sliding_window"), [t == "sliding_attention" for t in types])
    fields.update(swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)), swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))
    return fields
