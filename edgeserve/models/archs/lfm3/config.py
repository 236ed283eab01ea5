"""ModelConfig for LFM3 (HF `lfm3`; GGUF `lfm3`, our extension of llama.cpp's `lfm2` keys: see the package docstring).

Layers are `conv` (LFM2's gated short convolution of kernel `conv_L_cache`, state [K - 1, hidden]),
`sliding_attention` (a window of `sliding_window` tokens, RoPE base `rope_parameters.sliding_attention`) or
`full_attention` (proportional partial RoPE: only the first `partial_rotary_factor` of each head's frequency pairs
turn, frequencies over the whole head size). HF lists them in `layer_types` (default: transformers' rhythm, global
at i % 4 == 2, sliding at other multiples of 4, conv elsewhere); a GGUF by per-layer `attention.head_count_kv` (0 on
conv layers) and `attention.sliding_window_pattern`. The MLP width is `intermediate_size` as it is (no LFM2-style
adjustment)."""

from __future__ import annotations

from typing import Any, Mapping

from edgeserve.engine.cache.state_pool import short_conv_kind
from edgeserve.errors import ModelLoadError, UnsupportedModelError
from edgeserve.models.archs.lfm2.config import gguf_conv_fields, gguf_kv_heads
from edgeserve.models.config import ModelConfig, gguf_key

SLIDING, FULL = "sliding_attention", "full_attention"
_DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                 FULL: {"rope_type": "proportional", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5}}


def _layer_types(layers: int, cfg: Mapping[str, Any]) -> list[str]:
    """Each layer's kind, from `layer_types` or transformers' default rhythm."""
    types = cfg.get("layer_types") or [FULL if i % 4 == 2 else SLIDING if i % 4 == 0 and i > 0 else "conv"
                                       for i in range(layers)]
    if len(types) != layers:
        raise ModelLoadError(f"layer_types lists {len(types)} layers, the model has {layers}")
    unknown = set(types) - {"conv", SLIDING, FULL}
    if unknown:
        raise UnsupportedModelError(f"LFM3 layer types {sorted(unknown)} are not supported")
    return list(types)


def _hf_rope(cfg: Mapping[str, Any]) -> tuple[float, float, float]:
    """(sliding layers' RoPE base, global layers' base, the global layers' rotated fraction) of an HF LFM3 config."""
    rp = dict(cfg.get("rope_parameters") or _DEFAULT_ROPE)
    sliding, full = rp.get(SLIDING) or _DEFAULT_ROPE[SLIDING], rp.get(FULL) or _DEFAULT_ROPE[FULL]
    if sliding.get("rope_type", "default") != "default" or \
            full.get("rope_type", "default") not in ("default", "proportional") or float(full.get("factor", 1.0)) != 1:
        raise UnsupportedModelError(f"LFM3 RoPE parameters {rp} are not supported")
    partial = float(full.get("partial_rotary_factor", 1.0)) if full.get("rope_type") == "proportional" else 1.0
    return float(sliding.get("rope_theta", 10_000.0)), float(full.get("rope_theta", 1_000_000.0)), partial


def config_from_hf(arch: str, cfg: Mapping[str, Any]) -> ModelConfig:
    """An LFM3 ModelConfig from an HF config.json dict."""
    try:
        if cfg.get("conv_bias") or cfg.get("attention_bias"):
            raise UnsupportedModelError("LFM3 with conv_bias or attention_bias is not supported (no released "
                                        "checkpoint has them)")
        layers, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        types = _layer_types(layers, cfg)
        window = int(cfg.get("sliding_window") or 0)
        local_theta, global_theta, partial = _hf_rope(cfg)
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("norm_eps", 1e-5)),
            rope_theta=global_theta,
            rope_local_theta=local_theta,
            rope_global_partial=partial,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 128_000)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            qk_norm=True,
            sandwich_norms=bool(cfg.get("use_sandwich_norm", True)),
            layer_windows=_windows(types, window),
            linear_layers=tuple(t == "conv" for t in types),
            state_kind=short_conv_kind(int(cfg.get("conv_L_cache", 7)), hidden),
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json is missing {e.args[0]!r}") from None


def _windows(types: list[str], window: int) -> tuple[int | None, ...] | None:
    """Each layer's sliding window (None: global or conv); None when no layer has one."""
    windows = tuple(window if t == SLIDING and window else None for t in types)
    return windows if any(windows) else None


def config_from_gguf(arch: str, metadata: Mapping[str, Any], tensor_names: set[str]) -> ModelConfig:
    """An LFM3 ModelConfig from our `lfm3.*` metadata (per-layer KV heads, 0 on the conv layers; the sliding
    pattern). The global layers' proportional RoPE is the file's `rope_freqs.weight` (the model reads it)."""
    key = gguf_key(metadata, arch)
    layers = int(key("block_count"))
    kv = gguf_kv_heads(key, layers)
    if len(kv) != layers or not any(kv) or len({n for n in kv if n}) != 1:
        raise ModelLoadError(f"{arch}.attention.head_count_kv {kv} does not fit {layers} layers of one KV width")
    pattern = list(metadata.get(f"{arch}.attention.sliding_window_pattern") or [False] * layers)
    if len(pattern) != layers:
        raise ModelLoadError(f"{arch}.attention.sliding_window_pattern lists {len(pattern)} layers, not {layers}")
    types = ["conv" if not n else SLIDING if p else FULL for n, p in zip(kv, pattern)]
    return ModelConfig(
        **gguf_conv_fields(arch, metadata, tensor_names, kv),
        rope_local_theta=float(key("rope.freq_base_swa", 10_000.0)),
        sandwich_norms="blk.0.post_attention_norm.weight" in tensor_names,
        layer_windows=_windows(types, int(metadata.get(f"{arch}.attention.sliding_window") or 0)),
    )
