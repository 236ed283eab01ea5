"""Which decoder class runs which architecture."""

from __future__ import annotations

from .config import GEMMA_ARCHITECTURES, ModelConfig
from .gemma import GemmaModel
from .gemma4 import Gemma4Model
from .llama import LlamaModel
from .phi3 import Phi3Model


def decoder_class(config: ModelConfig) -> type[LlamaModel]:
    """The decoder that runs `config`'s architecture: Gemma 4's or Gemma 2/3's block, Phi-3's fused weights,
    else Llama's."""
    if config.architecture == "gemma4":
        return Gemma4Model
    if config.architecture in GEMMA_ARCHITECTURES:
        return GemmaModel
    if config.architecture == "phi3":
        return Phi3Model
    return LlamaModel
