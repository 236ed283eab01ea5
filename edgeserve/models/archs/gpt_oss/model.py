"""The decoder of gpt-oss."""

from __future__ import annotations

from edgeserve.models.config import ModelConfig
from edgeserve.models.gpt_oss import GptOssModel


def model_class(config: ModelConfig) -> type[GptOssModel]:
    """gpt-oss's decoder (sinks, biases, its experts; DummyWeights draws its HF names too)."""
    return GptOssModel
