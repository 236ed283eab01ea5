"""The Qwen2 / Qwen3 (and their VL text models') own ModelConfig fields."""

from __future__ import annotations

from typing import Any, Mapping

from edgeserve.models.config import ModelConfig, multimodal_text_config


def text_config(arch: str, cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """A VL model's language model from its multimodal config; the others' config as it is."""
    return multimodal_text_config(cfg) if arch in ("qwen2vl", "qwen3vl") else cfg


def fields_from_hf(config: ModelConfig, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen2's default q/k/v biases, Qwen3's Q/K norms, the VL models' M-RoPE sections."""
    arch = config.architecture
    if arch == "qwen2":
        return dict(attention_bias=bool(cfg.get("attention_bias", True)))
    if arch == "qwen3":
        return dict(qk_norm=True)
    rp = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    sections = rp.get("mrope_section") or cfg.get("mrope_section")
    mrope = dict(mrope_sections=tuple(int(s) for s in sections) if sections else None)
    if arch == "qwen2vl":  # Qwen2's block (q/k/v biases), the sections in contiguous runs
        return dict(mrope, attention_bias=True)
    return dict(mrope, qk_norm=True, mrope_interleaved=True)


def fields_from_gguf(config: ModelConfig, metadata: Mapping[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """The VL models' M-RoPE sections (llama.cpp writes 4: t, h, w, unused); Qwen2 / Qwen3 read only shared keys."""
    arch = config.architecture
    if arch not in ("qwen2vl", "qwen3vl"):
        return {}
    sections = metadata.get(f"{arch}.rope.dimension_sections")
    return dict(mrope_interleaved=arch == "qwen3vl",
                mrope_sections=tuple(int(s) for s in sections[:3]) if sections else None)
