"""ModelConfig for Granite 4 H (llama.cpp `granitehybrid`, HF `granitemoehybrid`), dense.

HF lists the layers in `layer_types` ("mamba" / "linear_attention", "attention" / "full_attention"). A GGUF's
layer kinds are read off its tensors (`ssm_in` or `attn_q`): llama.cpp's converter, reading the config through
transformers 5's AutoConfig (which renames the kinds), writes 0 KV heads for every layer. Only the released hybrids'
no-RoPE attention (`position_embedding_type` "nope") is supported. With experts (Tiny, Small: `num_local_experts`),
HF's `intermediate_size` is each expert's width and `shared_intermediate_size` the MLP's; the router's top k logits,
softmaxed, weigh the chosen experts (the shared MoE layer's softmax_topk with renormalization: the same weights).
"""

from __future__ import annotations

from typing import Any, Mapping

from edgeserve.engine.cache.state_pool import mamba2_kind
from edgeserve.errors import ModelLoadError, UnsupportedModelError
from edgeserve.kernels.torch.mamba2 import Mamba2Dims
from edgeserve.models.config import ModelConfig, gguf_key, gguf_vocab_size

_MAMBA, _ATTENTION = {"mamba", "linear_attention"}, {"attention", "full_attention"}


def _config(arch: str, mamba: tuple[bool, ...], dims: Mamba2Dims, **fields: Any) -> ModelConfig:
    if all(mamba) or not any(mamba):
        raise UnsupportedModelError("Granite 4 H needs both Mamba-2 and attention layers (a pure one is `granite`)")
    return ModelConfig(architecture=arch, num_layers=len(mamba), rope_theta=10000.0, linear_layers=mamba,
                       state_kind=mamba2_kind(dims.conv_kernel, dims.conv_dim, dims.num_heads, dims.head_dim,
                                              dims.state_size), **fields)


def config_from_hf(arch: str, cfg: Mapping[str, Any]) -> ModelConfig:
    """A Granite 4 H ModelConfig from an HF config.json dict."""
    try:
        if (cfg.get("position_embedding_type") or "nope") != "nope":
            raise UnsupportedModelError("Granite 4 H with RoPE attention is not supported")
        if cfg.get("hidden_act", "silu") != "silu" or cfg.get("attention_bias") or cfg.get("mamba_proj_bias"):
            raise UnsupportedModelError("Granite 4 H with biases or activations other than SiLU is not supported")
        types = list(cfg["layer_types"])
        unknown = sorted(set(types) - _MAMBA - _ATTENTION)
        if unknown:
            raise UnsupportedModelError(f"Granite 4 H layer types {unknown} are not supported")
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        ssm_heads = int(cfg["mamba_n_heads"])
        head = cfg.get("mamba_d_head", "auto")
        inner = int(cfg.get("mamba_expand", 2)) * hidden
        dims = Mamba2Dims(ssm_heads, inner // ssm_heads if head == "auto" else int(head), int(cfg["mamba_d_state"]),
                          int(cfg.get("mamba_n_groups", 1)), int(cfg.get("mamba_d_conv", 4)))
        head_dim = hidden // heads
        return _config(arch, tuple(t in _MAMBA for t in types), dims, vocab_size=int(cfg["vocab_size"]),
                       hidden_size=hidden, intermediate_size=int(cfg["shared_intermediate_size"]), num_heads=heads,
                       num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim,
                       rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                       max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                       tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                       embed_scale=float(cfg.get("embedding_multiplier", 1.0)),
                       residual_scale=float(cfg.get("residual_multiplier", 1.0)),
                       query_scale=float(cfg.get("attention_multiplier", head_dim ** -0.5)),
                       logit_scale=float(cfg.get("logits_scaling", 1.0)), **_experts_from_hf(cfg))
    except KeyError as e:
        raise ModelLoadError(f"config.json is missing {e.args[0]!r}") from None


def _experts_from_hf(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The expert fields of a config with `num_local_experts` (none without)."""
    experts = int(cfg.get("num_local_experts") or 0)
    if not experts:
        return {}
    return dict(num_experts=experts, experts_per_token=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True)


def config_from_gguf(arch: str, metadata: Mapping[str, Any], tensor_names: set[str]) -> ModelConfig:
    """A Granite 4 H ModelConfig from llama.cpp's `granitehybrid.*` metadata, each layer's kind from its tensors."""
    key = gguf_key(metadata, arch)
    experts = int(key("expert_count", 0))
    moe = dict(num_experts=experts, experts_per_token=int(key("expert_used_count")),
               moe_intermediate_size=int(key("feed_forward_length")), norm_topk_prob=True) if experts else {}
    layers, hidden = int(key("block_count")), int(key("embedding_length"))
    mamba = []
    for i in range(layers):
        ssm, att = f"blk.{i}.ssm_in.weight" in tensor_names, f"blk.{i}.attn_q.weight" in tensor_names
        if ssm == att:
            raise ModelLoadError(f"layer {i} of the GGUF has {'both' if ssm else 'neither'} Mamba-2 and attention")
        mamba.append(ssm)
    kv = key("attention.head_count_kv")
    kv = max([int(kv)] if isinstance(kv, (int, float)) else [int(n) for n in kv])
    heads, inner, ssm_heads = int(key("attention.head_count")), int(key("ssm.inner_size")), int(
        key("ssm.time_step_rank"))
    dims = Mamba2Dims(ssm_heads, inner // ssm_heads, int(key("ssm.state_size")), int(key("ssm.group_count")),
                      int(key("ssm.conv_kernel")))
    vocab = gguf_vocab_size(metadata, arch)
    head_dim = hidden // heads
    return _config(arch, tuple(mamba), dims, vocab_size=int(vocab), hidden_size=hidden,
                   intermediate_size=int(key("expert_shared_feed_forward_length", 0) or key("feed_forward_length")),
                   num_heads=heads,
                   num_kv_heads=kv or heads,  # 0 everywhere in files converted under transformers 5: no GQA to know
                   head_dim=head_dim, rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
                   max_position_embeddings=int(key("context_length", 1 << 20)),
                   tie_word_embeddings="output.weight" not in tensor_names,
                   embed_scale=float(key("embedding_scale", 1.0)), residual_scale=float(key("residual_scale", 1.0)),
                   query_scale=float(key("attention.scale", head_dim ** -0.5)),
                   logit_scale=float(key("logit_scale", 1.0)), **moe)
