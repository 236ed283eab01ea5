"""The decoder of Llama and its variants."""

from __future__ import annotations

from edgeserve.models.config import ModelConfig
from edgeserve.models.llama import LlamaModel


def model_class(config: ModelConfig) -> type[LlamaModel]:
    """Llama's decoder (the variants' fields switch its options)."""
    return LlamaModel
