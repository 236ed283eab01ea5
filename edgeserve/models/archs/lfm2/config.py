"""ModelConfig for LFM2 (llama.cpp `lfm2`, HF `lfm2`) and LFM2-MoE (llama.cpp `lfm2moe`, HF `lfm2_moe`).

Layers are `conv` (a gated short convolution of kernel `conv_L_cache`, state [K - 1, hidden]) or `full_attention`:
HF lists them in `layer_types` (older configs: `full_attn_idxs`); llama.cpp's converter writes a per-layer
`attention.head_count_kv` with 0 for the conv layers. HF's `intermediate_size` (or `block_ff_dim`) is adjusted as
the checkpoints' MLP was built (2/3 of it, times `block_ffn_dim_multiplier`, rounded up to `block_multiple_of`);
the GGUF stores the adjusted width. LFM2-MoE's dense layers take `intermediate_size` as it is, its experts
`moe_intermediate_size`; which layers are dense the weights say (a router or not), and the chosen experts' weights are
always renormalized (llama.cpp writes no key for it). A `routed_scaling_factor` other than 1 (llama.cpp ignores it;
no released checkpoint has one) is refused.
"""

from __future__ import annotations

from typing import Any, Mapping

from edgeserve.engine.cache.state_pool import short_conv_kind
from edgeserve.errors import ModelLoadError, UnsupportedModelError
from edgeserve.models.config import ModelConfig, gguf_key, gguf_vocab_size, layer_flags


def _conv_layers(layers: int, cfg: Mapping[str, Any]) -> tuple[bool, ...]:
    """Per layer: True for a short-conv layer, from `layer_types` or `full_attn_idxs`."""
    types = cfg.get("layer_types")
    if types is None:
        full = cfg.get("full_attn_idxs")
        full = set(range(layers)) if full is None else set(full)
        types = ["full_attention" if i in full else "conv" for i in range(layers)]
    return layer_flags(types, layers, "conv", "full_attention", "LFM2")


def feed_forward_width(cfg: Mapping[str, Any]) -> int:
    """The MLP width the checkpoint's weights have (HF Lfm2MLP's adjustment of `intermediate_size`)."""
    width = int(cfg.get("block_ff_dim") or cfg["intermediate_size"])
    if cfg.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        multiplier = cfg.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            multiple = int(cfg.get("block_multiple_of", 256))
            width = int(multiplier * width)
            width = multiple * ((width + multiple - 1) // multiple)
    return width


def _rope_theta(cfg: Mapping[str, Any]) -> float:
    rp = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if rp.get("rope_type", rp.get("type", "default")) != "default":
        raise UnsupportedModelError(f"LFM2 RoPE type {rp.get('rope_type')!r} is not supported")
    return float(rp.get("rope_theta", cfg.get("rope_theta", 1_000_000.0)))


def _moe_from_hf(arch: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """LFM2-MoE's expert fields and its dense layers' width (empty for LFM2, whose width is adjusted)."""
    if arch != "lfm2moe":
        return dict(intermediate_size=feed_forward_width(cfg))
    if float(cfg.get("routed_scaling_factor", 1.0)) != 1.0:
        raise UnsupportedModelError(f"LFM2-MoE with routed_scaling_factor {cfg['routed_scaling_factor']} is not "
                                    "supported")
    return dict(intermediate_size=int(cfg["intermediate_size"]), num_experts=int(cfg["num_experts"]),
                experts_per_token=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)))


def config_from_hf(arch: str, cfg: Mapping[str, Any]) -> ModelConfig:
    """An LFM2 / LFM2-MoE ModelConfig from an HF config.json dict."""
    try:
        if cfg.get("conv_bias"):
            raise UnsupportedModelError("LFM2 with conv_bias is not supported (no released checkpoint has it)")
        layers, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=hidden // heads,
            rms_norm_eps=float(cfg.get("norm_eps", 1e-5)),
            rope_theta=_rope_theta(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 128_000)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", cfg.get("tie_embedding", True))),
            qk_norm=True,
            linear_layers=_conv_layers(layers, cfg),
            state_kind=short_conv_kind(int(cfg.get("conv_L_cache", 3)), hidden),
            **_moe_from_hf(arch, cfg),
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json is missing {e.args[0]!r}") from None


def config_from_gguf(arch: str, metadata: Mapping[str, Any], tensor_names: set[str]) -> ModelConfig:
    """An LFM2 / LFM2-MoE ModelConfig from llama.cpp's `lfm2.*` / `lfm2moe.*` metadata (per-layer KV heads, 0 on
    the conv layers)."""
    key = gguf_key(metadata, arch)
    layers = int(key("block_count"))
    kv = gguf_kv_heads(key, layers)
    if len(kv) != layers or not any(kv):
        raise ModelLoadError(f"{arch}.attention.head_count_kv {kv} does not fit {layers} layers with attention")
    if len({n for n in kv if n}) != 1:
        raise UnsupportedModelError(f"{arch} with attention layers of different KV heads {kv} is not supported")
    if int(metadata.get(f"{arch}.attention.sliding_window") or 0):
        raise UnsupportedModelError(f"a sliding-window {arch} GGUF (an audio tokenizer) is not supported")
    return ModelConfig(**gguf_conv_fields(arch, metadata, tensor_names, kv), **_moe_from_gguf(arch, key))


def gguf_kv_heads(key, layers: int) -> list[int]:
    """Per-layer KV heads from `attention.head_count_kv` (one number for all layers, or a list; 0 on conv layers).
    `key` is the file's gguf_key reader."""
    kv = key("attention.head_count_kv")
    return [int(kv)] * layers if isinstance(kv, (int, float)) else [int(n) for n in kv]


def gguf_conv_fields(arch: str, metadata: Mapping[str, Any], tensor_names: set[str], kv: list[int]) -> dict[str, Any]:
    """The ModelConfig fields an LFM2-family GGUF (LFM2, LFM2-MoE, LFM3) gives alike, for the per-layer KV heads
    `kv` (0 on the short-conv layers): sizes, norms, the global RoPE base, tied embeddings, QK norms, conv state."""
    key = gguf_key(metadata, arch)
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    return dict(
        architecture=arch,
        vocab_size=gguf_vocab_size(metadata, arch),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=len(kv),
        num_heads=heads,
        num_kv_heads=max(kv),
        head_dim=int(metadata.get(f"{arch}.attention.key_length") or hidden // heads),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 1_000_000.0)),
        max_position_embeddings=int(key("context_length", 128_000)),
        tie_word_embeddings="output.weight" not in tensor_names,
        qk_norm=True,
        linear_layers=tuple(n == 0 for n in kv),
        state_kind=short_conv_kind(int(key("shortconv.l_cache")), hidden),
    )


def _moe_from_gguf(arch: str, key) -> dict[str, Any]:
    """LFM2-MoE's expert fields from `lfm2moe.expert_*` (sigmoid gating is the only kind it has)."""
    if arch != "lfm2moe":
        return {}
    gating = int(key("expert_gating_func", 2))
    if gating != 2:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
        raise UnsupportedModelError(f"{arch} with expert gating function {gating} is not supported (sigmoid: 2)")
    return dict(num_experts=int(key("expert_count")), experts_per_token=int(key("expert_used_count")),
                moe_intermediate_size=int(key("expert_feed_forward_length")), norm_topk_prob=True)
