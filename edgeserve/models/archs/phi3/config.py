"""Phi-3's own ModelConfig fields: its window, partial RoPE and (GGUF) longrope from the factor tensors."""

from __future__ import annotations

from typing import Any, Mapping

from edgeserve.models.config import ModelConfig, RopeScaling, gguf_key


def rope_scaling_from_gguf(arch: str, metadata: Mapping[str, Any], tensor_names: set[str]) -> RopeScaling | None:
    """Longrope where the file holds its factors as tensors, else None."""
    if "rope_factors_short.weight" not in tensor_names:
        return None
    return RopeScaling("longrope", factor=float(metadata.get(f"{arch}.rope.scaling.attn_factor") or 1.0),
                       original_max_position_embeddings=int(gguf_key(metadata, arch)(
                           "rope.scaling.original_context_length")))


def fields_from_gguf(config: ModelConfig, metadata: Mapping[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """Its sliding window and partial RoPE (`rope.dimension_count` below the head size)."""
    arch, head_dim = config.architecture, config.head_dim
    window = metadata.get(f"{arch}.attention.sliding_window")
    rotary = int(metadata.get(f"{arch}.rope.dimension_count") or head_dim)
    return dict(sliding_window=int(window) if window else None, rotary_dim=rotary if rotary < head_dim else None)


def fields_from_hf(config: ModelConfig, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Its window, which applies unless the config says not."""
    return dict(sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None)
