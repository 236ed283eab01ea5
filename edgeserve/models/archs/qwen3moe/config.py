"""Qwen3-MoE's own ModelConfig fields (its experts are shared keys, read by edgeserve.models.config)."""

from __future__ import annotations

from typing import Any, Mapping

from edgeserve.models.config import ModelConfig


def fields_from_hf(config: ModelConfig, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3's per-head Q/K norms."""
    return dict(qk_norm=True)
