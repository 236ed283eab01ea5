"""ModelConfig for Nemotron-H (llama.cpp `nemotron_h`, HF `nemotron_h`).

Each block has one mixer: HF lists them in `layers_block_type` ("mamba" / "linear_attention", "attention" /
"full_attention", "mlp"; "moe" is refused) or, in the released configs, as the `hybrid_override_pattern` string
(M, *, -); llama.cpp's converter writes per-layer `attention.head_count_kv` (non-zero on attention blocks) and
`feed_forward_length` (non-zero on MLP blocks), the rest being Mamba-2 blocks. The Mamba-2 layers' shape becomes the
state pool's `mamba2` kind (conv [K - 1, H * P + 2 * G * N], ssm [H, P, N]); `mamba2_dims` reads it back.
"""

from __future__ import annotations

from typing import Any, Mapping

from edgeserve.engine.state_pool import mamba2_kind
from edgeserve.errors import ModelLoadError, UnsupportedModelError
from edgeserve.kernels.mamba2 import Mamba2Dims
from edgeserve.models.config import ModelConfig, gguf_key

_KINDS = {"M": "M", "mamba": "M", "linear_attention": "M", "*": "*", "attention": "*", "full_attention": "*",
          "-": "-", "mlp": "-"}


def _block_kinds(cfg: Mapping[str, Any]) -> str:
    """The blocks' mixers as a pattern string of M, * and -."""
    types = cfg.get("hybrid_override_pattern") or cfg.get("layers_block_type") or cfg.get("layer_types")
    if not types:
        raise ModelLoadError("config.json has neither hybrid_override_pattern nor layers_block_type")
    unknown = sorted({str(t) for t in types} - set(_KINDS))
    if unknown:
        raise UnsupportedModelError(f"Nemotron-H block types {unknown} are not supported (MoE blocks: "
                                    "nemotron_h_moe is not supported)")
    return "".join(_KINDS[t] for t in types)


def _config(arch: str, pattern: str, dims: Mamba2Dims, **fields: Any) -> ModelConfig:
    """The ModelConfig of a block pattern and Mamba-2 shape, with the shared fields."""
    if "*" not in pattern:
        raise UnsupportedModelError("a Nemotron-H without attention blocks is not supported")
    return ModelConfig(architecture=arch, num_layers=len(pattern), rope_theta=10000.0,
                       linear_layers=tuple(k == "M" for k in pattern),
                       mixerless_layers=tuple(k == "-" for k in pattern),
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
        return _config(arch, _block_kinds(cfg), dims, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
                       intermediate_size=int(cfg["intermediate_size"]), num_heads=heads,
                       num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                       head_dim=int(cfg.get("head_dim") or hidden // heads),
                       rms_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
                       max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                       tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))
    except KeyError as e:
        raise ModelLoadError(f"config.json is missing {e.args[0]!r}") from None


def _per_layer(value: Any, layers: int) -> list[int]:
    return [int(value)] * layers if isinstance(value, (int, float)) else [int(n) for n in value]


def _gguf_block_kinds(layers: int, tensor_names: set[str]) -> str:
    """The blocks' mixers as M, * and -, by the tensors each block has (llama.cpp's per-layer widths are 0 for the
    MLP blocks of a file converted as `nemotron_h_moe`)."""
    if any("ffn_gate_inp" in n or "_exps" in n for n in tensor_names):
        raise UnsupportedModelError("Nemotron-H with experts (nemotron_h_moe) is not supported")
    kinds = []
    for i in range(layers):
        has = {k for k in ("ssm_in", "attn_q", "ffn_up") if f"blk.{i}.{k}.weight" in tensor_names}
        if len(has) != 1:
            raise ModelLoadError(f"block {i} of the GGUF has mixers {sorted(has)}, expected exactly one")
        kinds.append({"ssm_in": "M", "attn_q": "*", "ffn_up": "-"}[has.pop()])
    return "".join(kinds)


def config_from_gguf(arch: str, metadata: Mapping[str, Any], tensor_names: set[str]) -> ModelConfig:
    """A Nemotron-H ModelConfig from llama.cpp's `nemotron_h.*` metadata (also what a `nemotron_h_moe` file without
    experts holds); which mixer each block has its tensors say."""
    key = gguf_key(metadata, arch)
    layers, hidden = int(key("block_count")), int(key("embedding_length"))
    kv = _per_layer(key("attention.head_count_kv"), layers)
    ff = _per_layer(key("feed_forward_length", 0), layers)
    if len({n for n in kv if n}) > 1 or len({n for n in ff if n}) > 1:
        raise UnsupportedModelError(f"{arch} with KV heads {kv} / MLP widths {ff} per layer is not supported")
    pattern = _gguf_block_kinds(layers, tensor_names)
    heads, inner = int(key("attention.head_count")), int(key("ssm.inner_size"))
    ssm_heads = int(key("ssm.time_step_rank"))
    dims = Mamba2Dims(ssm_heads, inner // ssm_heads, int(key("ssm.state_size")), int(key("ssm.group_count")),
                      int(key("ssm.conv_kernel")))
    vocab = metadata.get(f"{arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens") or ())
    if not vocab:
        raise ModelLoadError("GGUF metadata has neither a vocab_size nor tokenizer tokens")
    return _config(arch, pattern, dims, vocab_size=int(vocab), hidden_size=hidden,
                   intermediate_size=max(ff),  # 0 in a nemotron_h_moe file: the MLP weights have their shape
                   num_heads=heads, num_kv_heads=max(kv),
                   head_dim=int(metadata.get(f"{arch}.attention.key_length") or hidden // heads),
                   rms_norm_eps=float(metadata.get(f"{arch}.attention.layer_norm_rms_epsilon")
                                      or key("attention.layer_norm_epsilon", 1e-5)),
                   max_position_embeddings=int(key("context_length", 1 << 20)),
                   tie_word_embeddings="output.weight" not in tensor_names)
