"""The decoder of Qwen3-MoE."""

from __future__ import annotations

from edgeserve.models.config import ModelConfig
from edgeserve.models.llama import LlamaModel
from edgeserve.models.moe_decoder import MoEModel


def model_class(config: ModelConfig) -> type[LlamaModel]:
    """Llama's decoder with Mixture-of-Experts layers (a file without experts: Llama's)."""
    return MoEModel if config.is_moe else LlamaModel
