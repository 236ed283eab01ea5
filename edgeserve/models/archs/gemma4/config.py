"""ModelConfig for Gemma 4 (`gemma4` in GGUF, `gemma4_text` / the multimodal `gemma4` config in HF).

Gemma 4's text block, as transformers' modeling_gemma4 runs it: sliding-window and global layers with their own head
sizes (and, with `attention_k_eq_v`, their own K/V head count and no V projection), "proportional" RoPE on the
global layers (only the first `partial_rotary_factor` of each head's frequency pairs rotate), an RMSNorm without
weight on V, attention scale 1, per-layer embeddings (E2B / E4B), the last `num_kv_shared_layers` layers reading
an earlier layer's K/V, a learned per-layer output scale and final logit soft-capping; the 26B-A4B size adds
routed experts (`enable_moe_block`) beside every layer's dense MLP. Its RMSNorm multiplies by
the stored weight as is (no 1 + w), in HF checkpoints and GGUF files alike.
"""

from __future__ import annotations

from typing import Any, Mapping

from edgeserve.errors import ModelLoadError, UnsupportedModelError

from edgeserve.models.config import ModelConfig, gguf_key, gguf_vocab_size

def _hf_rope(cfg: Mapping[str, Any]) -> tuple[float, float, float]:
    """(sliding layers' RoPE base, global layers' base, the global layers' partial rotary factor) of an HF Gemma 4
    config; UnsupportedModelError for RoPE kinds Gemma 4 does not use."""
    rp = cfg.get("rope_parameters") or {}
    sliding_rope = rp.get("sliding_attention") or {"rope_theta": 10_000.0}
    full_rope = rp.get("full_attention") or {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                             "rope_theta": 1_000_000.0}
    if full_rope.get("rope_type", "default") not in ("default", "proportional") or \
            sliding_rope.get("rope_type", "default") != "default" or float(full_rope.get("factor", 1.0)) != 1.0:
        raise UnsupportedModelError(f"Gemma 4 RoPE parameters {dict(rp)} are not supported")
    partial = float(full_rope.get("partial_rotary_factor", 1.0)) if full_rope.get("rope_type") == "proportional" \
        else 1.0
    return float(sliding_rope.get("rope_theta", 10_000.0)), float(full_rope.get("rope_theta", 1_000_000.0)), partial


def gemma4_config_from_hf(cfg: Mapping[str, Any]) -> ModelConfig:
    """A Gemma 4 ModelConfig from an HF config.json dict (a `gemma4_text` config or the multimodal one, whose
    `text_config` is the language model)."""
    if isinstance(cfg.get("text_config"), Mapping):
        cfg = cfg["text_config"]
    try:
        layers = int(cfg["num_hidden_layers"])
        hidden = int(cfg["hidden_size"])
        window = int(cfg.get("sliding_window") or 512)
        types = list(cfg.get("layer_types") or
                     ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)])
        types[-1] = "full_attention"  # transformers forces the last layer global
        windows = tuple(window if t == "sliding_attention" else None for t in types)
        head_dim = int(cfg.get("head_dim") or 256)
        kv_heads = int(cfg.get("num_key_value_heads") or 1)
        k_eq_v = bool(cfg.get("attention_k_eq_v", False))
        global_head_dim, global_kv = _global_overrides(cfg, windows, k_eq_v)
        local_theta, global_theta, partial = _hf_rope(cfg)
        shared = int(cfg.get("num_kv_shared_layers") or 0)
        ffn = int(cfg["intermediate_size"])
        double = bool(cfg.get("use_double_wide_mlp")) and shared > 0  # the KV-shared layers' MLP is twice as wide
        per_layer_ffn = tuple(ffn * 2 if i >= layers - shared else ffn for i in range(layers)) if double else None
        ple = cfg.get("hidden_size_per_layer_input", 256)
        return ModelConfig(
            architecture="gemma4",
            vocab_size=int(cfg.get("vocab_size") or 262_144),
            hidden_size=hidden,
            intermediate_size=ffn,
            num_layers=layers,
            num_heads=int(cfg["num_attention_heads"]),
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=global_theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 131_072)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            qk_norm=True,
            activation="gelu_tanh",
            sandwich_norms=True,
            embed_scale=hidden ** 0.5,
            layer_windows=windows,
            rope_local_theta=local_theta,
            query_scale=1.0,
            final_softcap=float(cfg["final_logit_softcapping"]) if cfg.get("final_logit_softcapping") else None,
            global_head_dim=global_head_dim,
            global_kv_heads=global_kv,
            global_k_eq_v=k_eq_v,
            rope_global_partial=partial,
            kv_shared_layers=shared,
            per_layer_input_size=int(ple or 0),
            layer_intermediate=per_layer_ffn,
            # 26B-A4B: every layer adds routed experts to its dense MLP
            num_experts=int(cfg["num_experts"]) if cfg.get("enable_moe_block") else 0,
            experts_per_token=int(cfg["top_k_experts"]) if cfg.get("enable_moe_block") else 0,
            moe_intermediate_size=int(cfg["moe_intermediate_size"]) if cfg.get("enable_moe_block") else 0,
            norm_topk_prob=True,
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json is missing {e.args[0]!r}") from None


def _global_overrides(cfg: Mapping[str, Any], windows: tuple[int | None, ...], k_eq_v: bool) -> tuple[int, int]:
    """(head size, K/V heads) of the global layers: from `global_head_dim` / `num_global_key_value_heads` (the
    latter only counts with `attention_k_eq_v`, as in transformers), or from a saved `per_layer_config`."""
    kv_heads = int(cfg.get("num_key_value_heads") or 1)
    head_dim = cfg.get("global_head_dim")
    global_kv = cfg.get("num_global_key_value_heads") if k_eq_v else None
    per_layer = cfg.get("per_layer_config") or {}
    first_global = windows.index(None)
    override = per_layer.get(str(first_global)) or per_layer.get(first_global) or {}
    head_dim = head_dim or override.get("head_dim") or (512 if not per_layer else cfg.get("head_dim") or 256)
    global_kv = global_kv or override.get("num_key_value_heads") or kv_heads
    return int(head_dim), int(global_kv)


def _gguf_windows(metadata: Mapping[str, Any], arch: str, layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: global) from `attention.sliding_window_pattern`, else Gemma 4's rhythm of
    five sliding layers and one global, the last layer global."""
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern")
    window = int(gguf_key(metadata, arch)("attention.sliding_window", 512))
    if isinstance(pattern, (list, tuple)) and len(pattern) == layers:
        return tuple(window if bool(p) else None for p in pattern)
    return tuple(None if (i + 1) % 6 == 0 or i == layers - 1 else window for i in range(layers))


def gemma4_config_from_gguf(metadata: Mapping[str, Any], tensor_names: set[str], arch: str = "gemma4") -> ModelConfig:
    """A Gemma 4 ModelConfig from llama.cpp's `gemma4.*` metadata (`arch`: the keys' prefix) and the file's tensor
    names."""
    key = gguf_key(metadata, arch)
    experts = int(metadata.get(f"{arch}.expert_count") or 0)
    layers = int(key("block_count"))
    hidden = int(key("embedding_length"))
    heads = _per_layer(key("attention.head_count"), layers)
    if len(set(heads)) != 1:
        raise UnsupportedModelError("Gemma 4 GGUF with a query head count that varies by layer is not supported")
    windows = _gguf_windows(metadata, arch, layers)
    first_sliding = next((i for i, w in enumerate(windows) if w is not None), None)
    first_global = windows.index(None)
    kv = _per_layer(key("attention.head_count_kv", heads[0]), layers)
    global_hd = int(key("attention.key_length"))
    sliding_hd = int(metadata.get(f"{arch}.attention.key_length_swa") or global_hd)
    ffn = _per_layer(key("feed_forward_length"), layers)
    shared = int(metadata.get(f"{arch}.attention.shared_kv_layers") or 0)
    owner = first_global if first_global < layers - shared else 0
    vocab = gguf_vocab_size(metadata, arch)
    softcap = metadata.get(f"{arch}.final_logit_softcapping")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=ffn[0],
        num_layers=layers,
        num_heads=heads[0],
        num_kv_heads=kv[first_sliding] if first_sliding is not None else kv[first_global],
        head_dim=sliding_hd,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 1_000_000.0)),
        max_position_embeddings=int(key("context_length", 131_072)),
        tie_word_embeddings="output.weight" not in tensor_names,
        qk_norm=True,
        activation="gelu_tanh",
        sandwich_norms=True,
        embed_scale=hidden ** 0.5,
        layer_windows=windows,
        rope_local_theta=float(metadata.get(f"{arch}.rope.freq_base_swa") or 10_000.0),
        query_scale=1.0,
        final_softcap=float(softcap) if softcap else None,
        global_head_dim=global_hd,
        global_kv_heads=kv[first_global],
        # the rotated share of the global heads comes from the file's `rope_freqs` tensor (see gemma4.py)
        global_k_eq_v=f"blk.{owner}.attn_k.weight" in tensor_names and f"blk.{owner}.attn_v.weight" not in tensor_names,
        kv_shared_layers=shared,
        per_layer_input_size=int(metadata.get(f"{arch}.embedding_length_per_layer_input") or 0),
        layer_intermediate=tuple(ffn) if len(set(ffn)) > 1 else None,
        num_experts=experts,
        experts_per_token=int(key("expert_used_count")) if experts else 0,
        moe_intermediate_size=int(key("expert_feed_forward_length")) if experts else 0,
        norm_topk_prob=True,
    )


def _per_layer(value: Any, layers: int) -> list[int]:
    """A GGUF value given once or per layer, as one int per layer."""
    if isinstance(value, (list, tuple)):
        if len(value) != layers:
            raise ModelLoadError(f"GGUF per-layer value has {len(value)} entries for {layers} layers")
        return [int(v) for v in value]
    return [int(value)] * layers


def config_from_gguf(arch: str, metadata: Mapping[str, Any], tensor_names: set[str]) -> ModelConfig:
    """edgeserve.models.registry's hook: Gemma 4 reads its whole config."""
    return gemma4_config_from_gguf(metadata, tensor_names)


def config_from_hf(arch: str, cfg: Mapping[str, Any]) -> ModelConfig:
    """edgeserve.models.registry's hook (the text model's config or the multimodal one's)."""
    return gemma4_config_from_hf(cfg)
