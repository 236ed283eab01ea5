"""The decoder of the Qwen3.5 hybrids."""

from __future__ import annotations

from edgeserve.models.config import ModelConfig
from edgeserve.models.qwen35 import Qwen35Model


def model_class(config: ModelConfig) -> type[Qwen35Model]:
    """The hybrid decoder (its native plan: kernels.cpu_decoder_qwen35)."""
    return Qwen35Model
