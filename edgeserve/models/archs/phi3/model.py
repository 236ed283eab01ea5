"""The decoder of Phi-3."""

from __future__ import annotations

from edgeserve.models.config import ModelConfig
from edgeserve.models.llama import LlamaModel
from edgeserve.models.phi3 import Phi3Model


def model_class(config: ModelConfig) -> type[LlamaModel]:
    """Llama's decoder over Phi-3's fused weights."""
    return Phi3Model


def dummy_model_class(config: ModelConfig) -> type[LlamaModel]:
    """Random weights (edgeserve.models.dummy, unfused Llama names) run Llama's block with Phi-3's sizes."""
    return LlamaModel
