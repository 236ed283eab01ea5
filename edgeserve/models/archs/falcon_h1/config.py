"""ModelConfig fields of Falcon-H1 (llama.cpp `falcon-h1`, HF `falcon_h1`) beyond the shared ones.

Every layer is a state layer that keeps KV too (`attention_beside_state`); the Mamba-2 shape becomes the state pool's
`mamba2` kind. An HF config's multipliers become `folded_scales`, the weight scales llama.cpp's converter folds into
the GGUF: embeddings and lm_head, Q / K / V (the attention input multiplier, K also the key multiplier), o_proj, the
MLP's gate and down, in_proj (the SSM input multiplier times the per-segment z / x / B / C / dt multipliers) and
out_proj. The gated norm after the scan is optional (`mamba_rms_norm`); norming before the gate is not supported.
"""

from __future__ import annotations

from typing import Any, Mapping

from edgeserve.engine.cache.state_pool import mamba2_kind
from edgeserve.errors import UnsupportedModelError
from edgeserve.kernels.torch.mamba2 import Mamba2Dims
from edgeserve.models.config import ModelConfig, gguf_key


def _state_fields(layers: int, dims: Mamba2Dims) -> dict[str, Any]:
    return dict(linear_layers=(True,) * layers, attention_beside_state=True,
                state_kind=mamba2_kind(dims.conv_kernel, dims.conv_dim, dims.num_heads, dims.head_dim,
                                       dims.state_size))


def _number(value: Any) -> float:
    """A float of config.json, where transformers writes infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, Mapping) else value)


def _check(cfg: Mapping[str, Any]) -> None:
    """Refuse the variants the decoder does not run, by name."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError("Falcon-H1 with an activation other than SiLU is not supported")
    if any(cfg.get(k) for k in ("attention_bias", "mlp_bias", "mamba_proj_bias", "projectors_bias")):
        raise UnsupportedModelError("Falcon-H1 with projection biases is not supported")
    if cfg.get("mamba_rms_norm") and cfg.get("mamba_norm_before_gate", True):
        raise UnsupportedModelError("Falcon-H1 with the Mamba norm before its gate is not supported")
    limit = tuple(_number(v) for v in cfg.get("time_step_limit") or (0.0, float("inf")))
    if limit != (0.0, float("inf")):
        raise UnsupportedModelError(f"Falcon-H1 with a time step limit {limit} is not supported")
    if cfg.get("tie_word_embeddings") and cfg.get("embedding_multiplier", 1.0) != cfg.get("lm_head_multiplier", 1.0):
        raise UnsupportedModelError("Falcon-H1 with tied embeddings and distinct multipliers is not supported")


def _folded_scales(cfg: Mapping[str, Any], dims: Mapping[str, int]) -> tuple[tuple[str, Any], ...]:
    """The weight scales of an HF config's multipliers (what llama.cpp's converter multiplies the tensors by)."""
    attn_in = float(cfg.get("attention_in_multiplier") or 1.0)
    gate, down = cfg.get("mlp_multipliers") or (1.0, 1.0)
    ssm_in = float(cfg.get("ssm_in_multiplier") or 1.0)
    segments = (dims["inner"], dims["inner"], dims["gn"], dims["gn"], dims["heads"])  # z, x, B, C, dt rows
    zxbcdt = [ssm_in * float(m) for m in (cfg.get("ssm_multipliers") or (1.0,) * 5)]
    return (("model.embed_tokens.weight", float(cfg.get("embedding_multiplier") or 1.0)),
            ("lm_head.weight", float(cfg.get("lm_head_multiplier") or 1.0)),
            ("self_attn.q_proj.weight", attn_in), ("self_attn.v_proj.weight", attn_in),
            ("self_attn.k_proj.weight", attn_in * float(cfg.get("key_multiplier") or 1.0)),
            ("self_attn.o_proj.weight", float(cfg.get("attention_out_multiplier") or 1.0)),
            ("feed_forward.gate_proj.weight", float(gate)), ("feed_forward.down_proj.weight", float(down)),
            ("mamba.in_proj.weight", (segments, tuple(zxbcdt))),
            ("mamba.out_proj.weight", float(cfg.get("ssm_out_multiplier") or 1.0)))


def fields_from_hf(config: ModelConfig, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Falcon-H1's own fields from an HF config.json dict."""
    _check(cfg)
    heads = int(cfg["mamba_n_heads"])
    inner = int(cfg.get("mamba_d_ssm") or int(cfg.get("mamba_expand", 2)) * config.hidden_size)
    head = cfg.get("mamba_d_head", "auto")
    dims = Mamba2Dims(heads, inner // heads if head in (None, "auto") else int(head), int(cfg["mamba_d_state"]),
                      int(cfg.get("mamba_n_groups", 1)), int(cfg.get("mamba_d_conv", 4)))
    sizes = dict(inner=dims.inner, gn=dims.n_groups * dims.state_size, heads=heads)
    return dict(_state_fields(config.num_layers, dims), folded_scales=_folded_scales(cfg, sizes))


def fields_from_gguf(config: ModelConfig, metadata: Mapping[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """Falcon-H1's own fields from llama.cpp's `falcon-h1.*` metadata (the multipliers already in the weights)."""
    key = gguf_key(metadata, config.architecture)
    heads, inner = int(key("ssm.time_step_rank")), int(key("ssm.inner_size"))
    dims = Mamba2Dims(heads, inner // heads, int(key("ssm.state_size")), int(key("ssm.group_count")),
                      int(key("ssm.conv_kernel")))
    return _state_fields(config.num_layers, dims)
