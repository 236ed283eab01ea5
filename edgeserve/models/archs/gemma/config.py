"""Gemma 2 / 3's own ModelConfig fields, from GGUF metadata or an HF config."""

from __future__ import annotations

from typing import Any, Mapping

from edgeserve.models.config import ModelConfig

# llama.cpp's sliding-window layer patterns: layer i is global when (i + 1) % pattern == 0
SWA_PATTERN = {"gemma2": 2, "gemma3": 6}


def _positive(value: Any) -> float | None:
    return float(value) if value else None


def text_config(arch: str, cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model of a multimodal Gemma 3 config; the others' config as it is."""
    if arch == "gemma3" and isinstance(cfg.get("text_config"), Mapping):
        return {**cfg["text_config"], "model_type": "gemma3"}
    return cfg


def fields_from_gguf(config: ModelConfig, metadata: Mapping[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """The Gemma-block fields from GGUF metadata. GGUF converters store Gemma's norm weights as 1 + w already, so no
    norm offset here."""
    arch, layers, hidden, heads = config.architecture, config.num_layers, config.hidden_size, config.num_heads
    window = metadata.get(f"{arch}.attention.sliding_window")
    pattern = SWA_PATTERN[arch]
    windows = tuple(None if window is None or (i + 1) % pattern == 0 else int(window) for i in range(layers))
    # llama.cpp: the 27B models scale queries by (hidden / heads) ** -0.5, the others by head_dim ** -0.5
    big = (arch == "gemma2" and layers == 46) or (arch == "gemma3" and layers == 62)
    fields: dict[str, Any] = dict(
        activation="gelu_tanh", sandwich_norms=True, embed_scale=hidden ** 0.5, layer_windows=windows,
        query_scale=(hidden // heads) ** -0.5 if big else config.head_dim ** -0.5,
        attn_softcap=_positive(metadata.get(f"{arch}.attn_logit_softcapping")),
        final_softcap=_positive(metadata.get(f"{arch}.final_logit_softcapping")),
    )
    if arch == "gemma3":
        fields["rope_local_theta"] = float(metadata.get(f"{arch}.rope.freq_base_swa", 10000.0))
    return fields


def fields_from_hf(config: ModelConfig, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The Gemma-block fields from an HF config."""
    arch, layers = config.architecture, config.num_layers
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if not types:
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or SWA_PATTERN[arch])
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    windows = tuple(int(window) if t == "sliding_attention" and window else None for t in types)
    fields: dict[str, Any] = dict(
        activation="gelu_tanh", norm_offset=1.0, sandwich_norms=True, embed_scale=int(cfg["hidden_size"]) ** 0.5,
        layer_windows=windows, query_scale=float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim")) ** -0.5,
        attn_softcap=_positive(cfg.get("attn_logit_softcapping")),
        final_softcap=_positive(cfg.get("final_logit_softcapping")),
    )
    if arch == "gemma3":
        rp = cfg.get("rope_parameters") or {}
        local = rp.get("sliding_attention") or {}
        fields.update(qk_norm=True,
                      rope_local_theta=float(cfg.get("rope_local_base_freq") or local.get("rope_theta") or 10000.0))
    return fields
