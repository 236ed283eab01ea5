"""ModelConfig fields of the Llama-family variants (issue 33): SmolLM3, OLMo 2 / OLMo 3, Ministral 3 / Mistral
Small 3.x, Granite 3.x dense and Qwen3-VL's text model, read from GGUF metadata or an HF config.

Each is the Llama decoder plus a few fields (edgeserve.models.llama), except OLMo 2 / 3, whose block has no
pre-norms (edgeserve.models.olmo2):
- smollm3: no RoPE on every 4th layer (HF `no_rope_layers`; llama.cpp hard-codes the step 4, no GGUF key).
- olmo2 (HF olmo2 / olmo3): RMSNorm after attention and after the MLP only; Q/K RMSNorm over the whole
  projection; OLMo 3's sliding-window layers (3 of every 4) with plain RoPE where the global ones scale it.
- mistral3 (HF ministral3, or the text part of mistral3): YaRN (its attention factor from `mscale` /
  `mscale_all_dim`) and Llama 4's attention temperature: queries times 1 + beta ln(1 + floor(pos / original)).
- granite: embedding, residual, attention and logits multipliers.
- qwen2vl (HF qwen2_5_vl / qwen2_vl's text model): Qwen2 with M-RoPE in contiguous sections (images as qwen3vl's,
  no DeepStack).
- qwen3vl (HF qwen3_vl's text model): Qwen3 with M-RoPE, which for text alone (every axis at the token's position)
  is 1-D RoPE; an image's tokens take (t, h, w) positions (edgeserve.models.mrope); DeepStack adds visual features
  to the first layers' hidden states at the image's rows, nothing without images.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from edgeserve.errors import ModelLoadError, UnsupportedModelError

VARIANT_ARCHITECTURES = ("smollm3", "olmo2", "mistral3", "granite", "qwen3vl", "qwen2vl")
# HF `model_type` spellings (of the top config) of the variants' names
VARIANT_HF_MODEL_TYPES = {"olmo3": "olmo2", "ministral3": "mistral3", "qwen3_vl": "qwen3vl",
                          "qwen3_vl_text": "qwen3vl", "qwen2_5_vl": "qwen2vl", "qwen2_5_vl_text": "qwen2vl",
                          "qwen2_vl": "qwen2vl", "qwen2_vl_text": "qwen2vl"}
VARIANT_HF_CLASSES = {
    "SmolLM3ForCausalLM": "smollm3",
    "Olmo2ForCausalLM": "olmo2",
    "Olmo3ForCausalLM": "olmo2",
    "Ministral3ForCausalLM": "mistral3",
    "Mistral3ForConditionalGeneration": "mistral3",
    "GraniteForCausalLM": "granite",
    "Qwen3VLForConditionalGeneration": "qwen3vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2vl",
    "Qwen2VLForConditionalGeneration": "qwen2vl",
}
# llama.cpp's NoPE step (hparams.n_no_rope_layer_step): layer i has no RoPE when (i + 1) % 4 == 0
SMOLLM3_NO_ROPE_STEP = 4
# llama.cpp's OLMo 3 window pattern: layer i is global when (i + 1) % 4 == 0
OLMO3_SWA_PATTERN = 4


def variant_text_config(arch: str, cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a multimodal HF config (Mistral 3, Qwen3-VL), else `cfg` itself."""
    if arch in ("mistral3", "qwen3vl", "qwen2vl") and isinstance(cfg.get("text_config"), Mapping):
        return {**cfg["text_config"], "tie_word_embeddings": cfg.get("tie_word_embeddings",
                                                                     cfg["text_config"].get("tie_word_embeddings"))}
    return cfg


def _rope_layers(pattern: list[bool]) -> tuple[bool, ...] | None:
    return tuple(pattern) if not all(pattern) else None


def _windows(window: Any, sliding: list[bool]) -> tuple[int | None, ...] | None:
    if not window or not any(sliding):
        return None
    return tuple(int(window) if s else None for s in sliding)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def variant_fields_from_hf(arch: str, cfg: Mapping[str, Any], layers: int) -> dict[str, Any]:
    """The variant's ModelConfig fields from its (text) HF config; empty for other architectures."""
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
    if arch == "olmo2":
        types = cfg.get("layer_types")
        if types is None and cfg.get("model_type") == "olmo3":
            types = ["full_attention" if (i + 1) % OLMO3_SWA_PATTERN == 0 else "sliding_attention"
                     for i in range(layers)]
        sliding = [t == "sliding_attention" for t in types or ()]
        return dict(post_norms=True, qk_norm=True, qk_norm_full=True, sliding_window=None,
                    layer_windows=_windows(cfg.get("sliding_window"), sliding))
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
        return dict(embed_scale=_multiplier(cfg.get("embedding_multiplier")),
                    residual_scale=float(cfg.get("residual_multiplier") or 1.0),
                    query_scale=_multiplier(cfg.get("attention_multiplier")),
                    logit_scale=float(cfg.get("logits_scaling") or 1.0))
    if arch in ("qwen3vl", "qwen2vl"):
        rp = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        sections = rp.get("mrope_section") or cfg.get("mrope_section")
        mrope = dict(mrope_sections=tuple(int(s) for s in sections) if sections else None)
        if arch == "qwen2vl":  # Qwen2's block (q/k/v biases), the sections in contiguous runs
            return dict(mrope, attention_bias=True)
        return dict(mrope, qk_norm=True, mrope_interleaved=True)
    return {}


def _multiplier(value: Any) -> float | None:
    return float(value) if value not in (None, 1, 1.0) else None


def yarn_attention_factor_from_hf(rs: Mapping[str, Any]) -> float | None:
    """YaRN's cos/sin factor as transformers derives it: `attention_factor` when given, else from `mscale` and
    `mscale_all_dim` when both are (Ministral 3: 1.0), else None (the default 0.1 ln(factor) + 1)."""
    if rs.get("attention_factor"):
        return float(rs["attention_factor"])
    mscale, all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
    if mscale and all_dim:
        factor = float(rs["factor"])
        return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(all_dim))
    return None


def variant_fields_from_gguf(arch: str, metadata: Mapping[str, Any], layers: int,
                             tensor_names: set[str]) -> dict[str, Any]:
    """The variant's ModelConfig fields from GGUF metadata (llama.cpp's keys); empty for other architectures."""
    def get(name: str) -> Any:
        return metadata.get(f"{arch}.{name}")

    if arch == "smollm3":
        return dict(rope_layers=_rope_layers([(i + 1) % SMOLLM3_NO_ROPE_STEP != 0 for i in range(layers)]))
    if arch == "olmo2":
        for name in ("attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"):
            if f"blk.0.{name}.weight" not in tensor_names:
                raise ModelLoadError(f"GGUF olmo2 model is missing tensor 'blk.0.{name}.weight'")
        pattern = get("attention.sliding_window_pattern")  # per layer: sliding or not (llama.cpp's converter)
        if pattern is None:
            pattern = [(i + 1) % OLMO3_SWA_PATTERN != 0 for i in range(layers)]
        return dict(post_norms=True, qk_norm_full=True, layer_windows=_windows(get("attention.sliding_window"),
                                                                               [bool(p) for p in pattern]))
    if arch == "mistral3":
        fields: dict[str, Any] = {}
        beta = float(get("attention.temperature_scale") or 0.0)
        if beta:  # its length: the key where written, else (as llama.cpp) YaRN's original context
            length = get("attention.temperature_length") or get("rope.scaling.original_context_length")
            if length is None:
                raise ModelLoadError(f"GGUF {arch}.attention.temperature_scale needs "
                                     f"{arch}.rope.scaling.original_context_length")
            fields.update(attn_temperature=beta, attn_temperature_length=int(length))
        return fields
    if arch in ("qwen3vl", "qwen2vl"):
        sections = get("rope.dimension_sections")  # llama.cpp writes 4 (t, h, w, unused)
        return dict(mrope_interleaved=arch == "qwen3vl",
                    mrope_sections=tuple(int(s) for s in sections[:3]) if sections else None)
    if arch == "granite":
        scale = get("attention.scale")
        return dict(embed_scale=_multiplier(get("embedding_scale")),
                    residual_scale=float(get("residual_scale") or 1.0),
                    query_scale=float(scale) if scale else None, logit_scale=float(get("logit_scale") or 1.0))
    return {}


def yarn_attention_factor_from_gguf(arch: str, metadata: Mapping[str, Any]) -> float | None:
    """YaRN's cos/sin factor where llama.cpp's converter writes it in its own way, or None: Ministral 3's from
    `rope.scaling.yarn_log_multiplier` (its `mscale_all_dim`, with `mscale` 1 unwritten); OLMo 3's HF
    `attention_factor` as `rope.scaling.attn_factor`."""
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if arch == "olmo2" and metadata.get(f"{arch}.rope.scaling.attn_factor") is not None:
        return float(metadata[f"{arch}.rope.scaling.attn_factor"])
    log_mul = metadata.get(f"{arch}.rope.scaling.yarn_log_multiplier")
    if arch != "mistral3" or log_mul is None or factor is None:
        return None
    return _yarn_mscale(float(factor)) / _yarn_mscale(float(factor), float(log_mul))
