"""The decoder of Gemma 4."""

from __future__ import annotations

from edgeserve.models.config import ModelConfig
from edgeserve.models.gemma4 import Gemma4Model


def model_class(config: ModelConfig) -> type[Gemma4Model]:
    """Gemma 4's block (its native plan: kernels.cpu_decoder_gemma4)."""
    return Gemma4Model
