"""OLMo 2 / 3's own ModelConfig fields."""

from __future__ import annotations

from typing import Any, Mapping

from edgeserve.errors import ModelLoadError
from edgeserve.models.config import ModelConfig, with_yarn_attention_factor

# llama.cpp's OLMo 3 window pattern: layer i is global when (i + 1) % 4 == 0
OLMO3_SWA_PATTERN = 4


def _windows(window: Any, sliding: list[bool]) -> tuple[int | None, ...] | None:
    if not window or not any(sliding):
        return None
    return tuple(int(window) if s else None for s in sliding)


def fields_from_hf(config: ModelConfig, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Its norms and (OLMo 3) sliding layers."""
    layers = config.num_layers
    types = cfg.get("layer_types")
    if types is None and cfg.get("model_type") == "olmo3":
        types = ["full_attention" if (i + 1) % OLMO3_SWA_PATTERN == 0 else "sliding_attention" for i in range(layers)]
    sliding = [t == "sliding_attention" for t in types or ()]
    return dict(post_norms=True, qk_norm=True, qk_norm_full=True, sliding_window=None,
                layer_windows=_windows(cfg.get("sliding_window"), sliding))


def fields_from_gguf(config: ModelConfig, metadata: Mapping[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """Its norms, sliding layers and OLMo 3's YaRN factor (HF `attention_factor` as `rope.scaling.attn_factor`)."""
    arch = config.architecture
    for name in ("attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"):
        if f"blk.0.{name}.weight" not in tensor_names:
            raise ModelLoadError(f"GGUF olmo2 model is missing tensor 'blk.0.{name}.weight'")
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern")  # per layer: sliding or not
    if pattern is None:
        pattern = [(i + 1) % OLMO3_SWA_PATTERN != 0 for i in range(config.num_layers)]
    factor = metadata.get(f"{arch}.rope.scaling.attn_factor")
    return dict(post_norms=True, qk_norm_full=True,
                layer_windows=_windows(metadata.get(f"{arch}.attention.sliding_window"), [bool(p) for p in pattern]),
                **with_yarn_attention_factor(config, float(factor) if factor is not None else None))
