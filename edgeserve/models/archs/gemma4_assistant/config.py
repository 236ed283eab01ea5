"""ModelConfig of a Gemma 4 assistant drafter: its `text_config` read as Gemma 4's (archs/gemma4/config.py; a unified
assistant's under Gemma 4 12B's defaults), every layer reading the target's K/V, no per-layer inputs, no soft-capping
(the assistant's logits are its head's as they are), `backbone_hidden_size`, the target's width, and with
`use_ordered_embeddings` the centroid mask's top k (`head_top_centroids`). GGUF:
llama.cpp's `gemma4-assistant.*` keys (its `embedding_length_out` is the target's width)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from edgeserve.errors import ModelLoadError
from edgeserve.models.archs.gemma4.config import gemma4_config_from_gguf, gemma4_config_from_hf
from edgeserve.models.archs.gemma4_unified.config import UNIFIED_DEFAULTS
from edgeserve.models.config import ModelConfig


def _drafter(config: ModelConfig, arch: str, backbone: int) -> ModelConfig:
    """`config` as a drafter's: all layers KV-shared, no per-layer inputs, no logit soft-capping."""
    if backbone <= 0:
        raise ModelLoadError("a Gemma 4 assistant's config names no target hidden size (backbone_hidden_size)")
    return replace(config, architecture=arch, kv_shared_layers=config.num_layers, per_layer_input_size=0,
                   final_softcap=None, layer_intermediate=None, backbone_hidden_size=backbone)


def config_from_hf(arch: str, cfg: Mapping[str, Any]) -> ModelConfig:
    """edgeserve.models.registry's hook: the assistant's `text_config` (Gemma 4's, or Gemma 4 12B's in a unified
    assistant) and its `backbone_hidden_size`."""
    text = dict(cfg.get("text_config") or {})
    if not text:
        raise ModelLoadError("a Gemma 4 assistant's config.json has no text_config")
    if text.get("model_type") == "gemma4_unified_text":
        text = {**UNIFIED_DEFAULTS, **{k: v for k, v in text.items() if v is not None}}
    text["hidden_size_per_layer_input"] = 0
    config = _drafter(gemma4_config_from_hf(text), arch, int(cfg.get("backbone_hidden_size") or 0))
    top = int(cfg.get("centroid_intermediate_top_k") or 32) if cfg.get("use_ordered_embeddings") else 0
    return replace(config, head_top_centroids=top)


def config_from_gguf(arch: str, metadata: Mapping[str, Any], tensor_names: set[str]) -> ModelConfig:
    """edgeserve.models.registry's hook: llama.cpp's `gemma4-assistant.*` keys, read as Gemma 4's."""
    backbone = int(metadata.get(f"{arch}.embedding_length_out") or 0)
    return _drafter(gemma4_config_from_gguf(metadata, tensor_names, arch), arch, backbone)
