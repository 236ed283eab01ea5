"""The Llama variants' own ModelConfig fields, from GGUF metadata or an HF config."""

from __future__ import annotations

from typing import Any, Mapping

from edgeserve.errors import ModelLoadError, UnsupportedModelError
from edgeserve.models.config import (ModelConfig, multimodal_text_config, with_yarn_attention_factor, yarn_mscale)

# llama.cpp's NoPE step (hparams.n_no_rope_layer_step): layer i has no RoPE when (i + 1) % 4 == 0
SMOLLM3_NO_ROPE_STEP = 4


def text_config(arch: str, cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """Mistral 3's language model from its multimodal config; the others' config as it is."""
    return multimodal_text_config(cfg) if arch == "mistral3" else cfg


def _rope_layers(pattern: list[bool]) -> tuple[bool, ...] | None:
    return tuple(pattern) if not all(pattern) else None


def multiplier(value: Any) -> float | None:
    """A scale factor, None where it is absent or 1."""
    return float(value) if value not in (None, 1, 1.0) else None


def fields_from_hf(config: ModelConfig, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The variant's fields from its (text) HF config; empty for plain Llama."""
    arch, layers = config.architecture, config.num_layers
    if arch == "mistral":  # its window applies unless the config says not
        return dict(sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None)
    if arch == "smollm3":
        if cfg.get("use_sliding_window"):
            raise UnsupportedModelError("SmolLM3 with use_sliding_window is not supported")
        flags = cfg.get("no_rope_layers")
        if flags is None:
            step = int(cfg.get("no_rope_layer_interval") or SMOLLM3_NO_ROPE_STEP)
            flags = [(i + 1) % step != 0 for i in range(layers)]
        if len(flags) != layers:
            raise ModelLoadError(f"config.json no_rope_layers has {len(flags)} entries for {layers} layers")
        return dict(rope_layers=_rope_layers([bool(f) for f in flags]))
    if arch == "mistral3":
        rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        beta = float(rp.get("llama_4_scaling_beta") or 0.0)
        if not beta:
            return {}
        if not rp.get("original_max_position_embeddings"):
            raise ModelLoadError("config.json rope_parameters has llama_4_scaling_beta but no "
                                 "original_max_position_embeddings (the attention temperature's length)")
        return dict(attn_temperature=beta, attn_temperature_length=int(rp["original_max_position_embeddings"]))
    if arch == "granite":
        return dict(embed_scale=multiplier(cfg.get("embedding_multiplier")),
                    residual_scale=float(cfg.get("residual_multiplier") or 1.0),
                    query_scale=multiplier(cfg.get("attention_multiplier")),
                    logit_scale=float(cfg.get("logits_scaling") or 1.0))
    return {}


def fields_from_gguf(config: ModelConfig, metadata: Mapping[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """The variant's fields from GGUF metadata (llama.cpp's keys); empty for plain Llama and Mistral."""
    arch, layers = config.architecture, config.num_layers

    def get(name: str) -> Any:
        return metadata.get(f"{arch}.{name}")

    if arch == "smollm3":
        return dict(rope_layers=_rope_layers([(i + 1) % SMOLLM3_NO_ROPE_STEP != 0 for i in range(layers)]))
    if arch == "mistral3":
        fields: dict[str, Any] = with_yarn_attention_factor(config, _mistral3_yarn_factor(metadata))
        beta = float(get("attention.temperature_scale") or 0.0)
        if beta:  # its length: the key where written, else (as llama.cpp) YaRN's original context
            length = get("attention.temperature_length") or get("rope.scaling.original_context_length")
            if length is None:
                raise ModelLoadError(f"GGUF {arch}.attention.temperature_scale needs "
                                     f"{arch}.rope.scaling.original_context_length")
            fields.update(attn_temperature=beta, attn_temperature_length=int(length))
        return fields
    if arch == "granite":
        scale = get("attention.scale")
        return dict(embed_scale=multiplier(get("embedding_scale")),
                    residual_scale=float(get("residual_scale") or 1.0),
                    query_scale=float(scale) if scale else None, logit_scale=float(get("logit_scale") or 1.0))
    return {}


def _mistral3_yarn_factor(metadata: Mapping[str, Any]) -> float | None:
    """Ministral 3's YaRN cos/sin factor from `rope.scaling.yarn_log_multiplier` (its `mscale_all_dim`, with
    `mscale` 1 unwritten), or None."""
    factor = metadata.get("mistral3.rope.scaling.factor")
    log_mul = metadata.get("mistral3.rope.scaling.yarn_log_multiplier")
    if log_mul is None or factor is None:
        return None
    return yarn_mscale(float(factor)) / yarn_mscale(float(factor), float(log_mul))
