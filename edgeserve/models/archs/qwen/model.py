"""The decoder of Qwen2 / Qwen3 and their VL text models."""

from __future__ import annotations

from edgeserve.models.config import ModelConfig
from edgeserve.models.llama import LlamaModel


def model_class(config: ModelConfig) -> type[LlamaModel]:
    """Llama's decoder (biases, Q/K norms and M-RoPE are its options)."""
    return LlamaModel
