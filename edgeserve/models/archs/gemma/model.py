"""The decoder of Gemma 2 / 3."""

from __future__ import annotations

from edgeserve.models.config import ModelConfig
from edgeserve.models.gemma import GemmaModel
from edgeserve.models.llama import LlamaModel


def model_class(config: ModelConfig) -> type[LlamaModel]:
    """Gemma's block."""
    return GemmaModel


def dummy_model_class(config: ModelConfig) -> type[LlamaModel]:
    """Random weights (edgeserve.models.dummy, Llama's names) run Llama's block with Gemma's sizes."""
    return LlamaModel
