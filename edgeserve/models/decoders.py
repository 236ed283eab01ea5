"""Which decoder class runs which architecture."""

from __future__ import annotations

from .config import GEMMA_ARCHITECTURES, HYBRID_ARCHITECTURES, ModelConfig
from .gemma import GemmaModel
from .gemma4 import Gemma4Model
from .gpt_oss import GptOssModel
from .llama import LlamaModel
from .moe_decoder import MoEModel
from .olmo2 import Olmo2Model
from .phi3 import Phi3Model
from .qwen35 import Qwen35Model


def decoder_class(config: ModelConfig) -> type[LlamaModel]:
    """The decoder that runs `config`'s architecture: Gemma 4's or Gemma 2/3's block, Phi-3's fused weights,
    Llama's with a Mixture-of-Experts feed-forward (gpt-oss's with its sinks and biases), the Qwen3.5 hybrids', else
    Llama's."""
    if config.architecture in HYBRID_ARCHITECTURES:
        return Qwen35Model
    if config.architecture == "gemma4":
        return Gemma4Model
    if config.architecture in GEMMA_ARCHITECTURES:
        return GemmaModel
    if config.architecture == "gpt-oss":
        return GptOssModel
    if config.architecture == "phi3":
        return Phi3Model
    if config.is_moe:
        return MoEModel
    if config.post_norms:  # OLMo 2 / 3 (issue 33's variants; the others run the Llama decoder with their flags)
        return Olmo2Model
    return LlamaModel
