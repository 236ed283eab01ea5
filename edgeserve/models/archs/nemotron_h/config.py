"""ModelConfig for Nemotron-H (llama.cpp `nemotron_h`, HF `nemotron_h`).

Each block has one mixer: HF lists them in `layers_block_type` ("mamba" / "linear_attention", "attention" /
"full_attention", "mlp", "moe") or, in the released configs, as the `hybrid_override_pattern` string (M, *, -, E);
llama.cpp's converter writes per-layer `attention.head_count_kv` (non-zero on attention blocks) and
`feed_forward_length` (non-zero on MLP / MoE blocks), the rest being Mamba-2 blocks. The Mamba-2 layers' shape
becomes the state pool's `mamba2` kind (conv [K - 1, H * P + 2 * G * N], ssm [H, P, N]); `mamba2_dims` reads it back.

A model with MoE blocks (Nemotron 3 Nano 30B-A3B) is `nemotron_h_moe`: each MoE block routes a token to its top k
of E non-gated squared-ReLU experts by the router's sigmoids plus a per-expert correction bias, weighs them by their
sigmoids (renormalized with `norm_topk_prob`) times `routed_scaling_factor`, and adds a shared squared-ReLU MLP.
llama.cpp's converter writes every Nemotron-H whose config has MoE keys (transformers 5's AutoConfig fills them in
for dense ones too) as `nemotron_h_moe`: a file without expert tensors is the dense `nemotron_h`.
"""

from __future__ import annotations

from typing import Any, Mapping

from edgeserve.engine.cache.state_pool import mamba2_kind
from edgeserve.errors import ModelLoadError, UnsupportedModelError
from edgeserve.kernels.torch.mamba2 import Mamba2Dims
from edgeserve.models.config import ModelConfig, gguf_key

_KINDS = {"M": "M", "mamba": "M", "linear_attention": "M", "*": "*", "attention": "*", "full_attention": "*",
          "-": "-", "mlp": "-", "E": "E", "moe": "E"}
MOE_ARCH = "nemotron_h_moe"


def _block_kinds(cfg: Mapping[str, Any]) -> str:
    """The blocks' mixers as a pattern string of M, *, - and E."""
    types = cfg.get("hybrid_override_pattern") or cfg.get("layers_block_type") or cfg.get("layer_types")
    if not types:
        raise ModelLoadError("config.json has neither hybrid_override_pattern nor layers_block_type")
    unknown = sorted({str(t) for t in types} - set(_KINDS))
    if unknown:
        raise UnsupportedModelError(f"Nemotron-H block types {unknown} are not supported")
    return "".join(_KINDS[t] for t in types)


def _config(arch: str, pattern: str, dims: Mamba2Dims, **fields: Any) -> ModelConfig:
    """The ModelConfig of a block pattern and Mamba-2 shape, with the shared fields."""
    if "*" not in pattern:
        raise UnsupportedModelError("a Nemotron-H without attention blocks is not supported")
    if ("E" in pattern) != bool(fields.get("num_experts")):
        raise ModelLoadError(f"Nemotron-H blocks {pattern!r} and {fields.get('num_experts', 0)} experts disagree")
    return ModelConfig(architecture=MOE_ARCH if "E" in pattern else arch, num_layers=len(pattern), rope_theta=10000.0,
                       linear_layers=tuple(k == "M" for k in pattern),
                       mixerless_layers=tuple(k in "-E" for k in pattern),
                       state_kind=mamba2_kind(dims.conv_kernel, dims.conv_dim, dims.num_heads, dims.head_dim,
                                              dims.state_size), **fields)


def mamba2_dims(config: ModelConfig) -> Mamba2Dims:
    """The Mamba-2 layers' shape, from the config's state kind."""
    (k1, conv_dim), (heads, head_dim, n) = (t.shape for t in config.layer_state.tensors)
    groups = (conv_dim - heads * head_dim) // (2 * n)
    return Mamba2Dims(heads, head_dim, n, groups, k1 + 1)


def config_from_hf(arch: str, cfg: Mapping[str, Any]) -> ModelConfig:
    """A Nemotron-H ModelConfig from an HF config.json dict."""
    try:
        if cfg.get("mlp_hidden_act", "relu2") != "relu2" or cfg.get("mamba_hidden_act", "silu") != "silu":
            raise UnsupportedModelError("Nemotron-H with activations other than relu2 / silu is not supported")
        if cfg.get("attention_bias") or cfg.get("mlp_bias") or cfg.get("use_bias") or cfg.get("mamba_proj_bias"):
            raise UnsupportedModelError("Nemotron-H with projection biases is not supported")
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        dims = Mamba2Dims(int(cfg["mamba_num_heads"]), int(cfg["mamba_head_dim"]), int(cfg["ssm_state_size"]),
                          int(cfg.get("n_groups", cfg.get("mamba_n_groups", 8))),
                          int(cfg.get("conv_kernel", cfg.get("mamba_d_conv", 4))))
        pattern = _block_kinds(cfg)
        experts = _experts_from_hf(cfg) if "E" in pattern else {}
        return _config(arch, pattern, dims, **experts, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
                       intermediate_size=int(cfg["intermediate_size"]), num_heads=heads,
                       num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                       head_dim=int(cfg.get("head_dim") or hidden // heads),
                       rms_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
                       max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                       tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))
    except KeyError as e:
        raise ModelLoadError(f"config.json is missing {e.args[0]!r}") from None


def _experts_from_hf(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The expert fields of a config with MoE blocks (the latent projections and group-limited routing of the larger
    Nemotron 3 models refused)."""
    if cfg.get("moe_latent_size"):
        raise UnsupportedModelError("Nemotron-H MoE with latent expert projections (moe_latent_size) is not supported")
    if int(cfg.get("topk_group") or 1) < int(cfg.get("n_group") or 1):
        raise UnsupportedModelError("Nemotron-H MoE with group-limited routing (topk_group < n_group) is not "
                                    "supported")
    return dict(num_experts=int(cfg["n_routed_experts"]), experts_per_token=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                shared_expert_intermediate_size=int(cfg["moe_shared_expert_intermediate_size"])
                * int(cfg.get("n_shared_experts") or 1),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0))


def _experts_from_gguf(arch: str, metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The expert fields of llama.cpp's `nemotron_h_moe.*` keys (per-layer expert counts and widths refused)."""
    key = gguf_key(metadata, arch)
    if metadata.get(f"{arch}.moe_latent_size"):
        raise UnsupportedModelError("Nemotron-H MoE with latent expert projections is not supported")
    used, ffn = key("expert_used_count"), key("expert_feed_forward_length")
    if not isinstance(used, (int, float)) and len(set(used)) > 1 or not isinstance(ffn, (int, float)) \
            and len({n for n in ffn if n}) > 1:
        raise UnsupportedModelError("Nemotron-H MoE with per-layer expert counts or widths is not supported")
    return dict(num_experts=int(key("expert_count")), experts_per_token=max(_per_layer(used, 1)),
                moe_intermediate_size=max(_per_layer(ffn, 1)),
                shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length")),
                norm_topk_prob=bool(key("expert_weights_norm", False)),
                routed_scaling_factor=float(key("expert_weights_scale", 1.0)))


def _per_layer(value: Any, layers: int) -> list[int]:
    return [int(value)] * layers if isinstance(value, (int, float)) else [int(n) for n in value]


_GGUF_MIXERS = {"ssm_in": "M", "attn_q": "*", "ffn_up": "-", "ffn_up_exps": "E"}


def _gguf_block_kinds(layers: int, tensor_names: set[str]) -> str:
    """The blocks' mixers as M, *, - and E, by the tensors each block has (llama.cpp's per-layer widths are 0 for
    the MLP blocks of a dense file converted as `nemotron_h_moe`)."""
    kinds = []
    for i in range(layers):
        has = {k for k in _GGUF_MIXERS if f"blk.{i}.{k}.weight" in tensor_names}
        if len(has) != 1:
            raise ModelLoadError(f"block {i} of the GGUF has mixers {sorted(has)}, expected exactly one")
        kinds.append(_GGUF_MIXERS[has.pop()])
    return "".join(kinds)


def config_from_gguf(arch: str, metadata: Mapping[str, Any], tensor_names: set[str]) -> ModelConfig:
    """A Nemotron-H ModelConfig from llama.cpp's `nemotron_h.*` or `nemotron_h_moe.*` metadata (`nemotron_h` where
    the file has no expert tensors); which mixer each block has its tensors say."""
    key = gguf_key(metadata, arch)
    layers, hidden = int(key("block_count")), int(key("embedding_length"))
    kv = _per_layer(key("attention.head_count_kv"), layers)
    ff = _per_layer(key("feed_forward_length", 0), layers)
    if len({n for n in kv if n}) > 1 or len({n for n in ff if n}) > 1:
        raise UnsupportedModelError(f"{arch} with KV heads {kv} / MLP widths {ff} per layer is not supported")
    pattern = _gguf_block_kinds(layers, tensor_names)
    experts = _experts_from_gguf(arch, metadata) if "E" in pattern else {}
    heads, inner = int(key("attention.head_count")), int(key("ssm.inner_size"))
    ssm_heads = int(key("ssm.time_step_rank"))
    dims = Mamba2Dims(ssm_heads, inner // ssm_heads, int(key("ssm.state_size")), int(key("ssm.group_count")),
                      int(key("ssm.conv_kernel")))
    vocab = metadata.get(f"{arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens") or ())
    if not vocab:
        raise ModelLoadError("GGUF metadata has neither a vocab_size nor tokenizer tokens")
    return _config("nemotron_h", pattern, dims, **experts, vocab_size=int(vocab), hidden_size=hidden,
                   intermediate_size=max(ff),  # 0 in a nemotron_h_moe file: the MLP weights have their shape
                   num_heads=heads, num_kv_heads=max(kv),
                   head_dim=int(metadata.get(f"{arch}.attention.key_length") or hidden // heads),
                   rms_norm_eps=float(metadata.get(f"{arch}.attention.layer_norm_rms_epsilon")
                                      or key("attention.layer_norm_epsilon", 1e-5)),
                   max_position_embeddings=int(key("context_length", 1 << 20)),
                   tie_word_embeddings="output.weight" not in tensor_names)
