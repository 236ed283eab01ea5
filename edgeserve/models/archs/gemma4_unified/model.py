"""Gemma 4 12B runs on Gemma 4's decoder (archs/gemma4/model.py) and its fused native plan
(models.archs.gemma4.native_plan): k_eq_v global layers, KV-shared layers and their double-wide MLP are its layer kinds."""

from __future__ import annotations

from edgeserve.models.archs.gemma4.model import Gemma4Model, dummy_shapes
from edgeserve.models.config import ModelConfig

__all__ = ["dummy_shapes", "model_class"]


def model_class(config: ModelConfig) -> type[Gemma4Model]:
    """Gemma 4's block (edgeserve.models.registry's hook)."""
    return Gemma4Model
