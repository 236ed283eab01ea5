"""ModelConfig for Gemma 4 12B (HF `gemma4_unified` / `gemma4_unified_text`): Gemma 4's text config
(archs/gemma4/config.py) under this model's own defaults, as transformers' Gemma4UnifiedTextConfig has them."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from edgeserve.errors import UnsupportedModelError
from edgeserve.models.archs.gemma4.config import gemma4_config_from_hf
from edgeserve.models.config import ModelConfig, multimodal_text_config

# Gemma4UnifiedTextConfig's defaults where they differ from Gemma 4's text config (no per-layer inputs)
UNIFIED_DEFAULTS = {"hidden_size_per_layer_input": 0, "sliding_window": 1024, "num_key_value_heads": 4,
                    "max_position_embeddings": 262_144}


def config_from_hf(arch: str, cfg: Mapping[str, Any]) -> ModelConfig:
    """edgeserve.models.registry's hook: the text model's config (the multimodal one's `text_config`, with its
    tie_word_embeddings) read as Gemma 4's. A model whose text attends bidirectionally everywhere
    (`use_bidirectional_attention: all`, an encoder) is refused."""
    text = multimodal_text_config(cfg)
    if text.get("use_bidirectional_attention") == "all":
        raise UnsupportedModelError("Gemma 4 unified with bidirectional attention over all tokens "
                                    "(use_bidirectional_attention: all) is an encoder; it is not supported")
    text = {**UNIFIED_DEFAULTS, **{k: v for k, v in text.items() if v is not None}}
    return replace(gemma4_config_from_hf(text), architecture=arch)
