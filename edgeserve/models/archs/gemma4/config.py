"""Gemma 4 reads its whole config (edgeserve.models.gemma4_config)."""

from __future__ import annotations

from typing import Any, Mapping

from edgeserve.models.config import ModelConfig
from edgeserve.models.gemma4_config import gemma4_config_from_gguf, gemma4_config_from_hf


def config_from_gguf(arch: str, metadata: Mapping[str, Any], tensor_names: set[str]) -> ModelConfig:
    """Gemma 4's ModelConfig from GGUF metadata."""
    return gemma4_config_from_gguf(metadata, tensor_names)


def config_from_hf(arch: str, cfg: Mapping[str, Any]) -> ModelConfig:
    """Gemma 4's ModelConfig from an HF config (the text model's or the multimodal one's)."""
    return gemma4_config_from_hf(cfg)
