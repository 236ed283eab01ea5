"""ModelConfig for the Qwen3.5 / 3.6 hybrids (llama.cpp `qwen35` / `qwen35moe`; HF `qwen3_5` / `qwen3_5_moe`, the
text model or the `text_config` of the multimodal one).

Three of every four layers (`layer_types`, or every layer but each `full_attention_interval`-th) are Gated DeltaNet
layers; the others are full attention with a sigmoid output gate (q_proj doubled per head), Q/K RMSNorm and RoPE on
the first `partial_rotary_factor` of each head (text-only M-RoPE: all position sections equal, so plain RoPE on
those dims). Every RMSNorm but the DeltaNet's gated one multiplies by (1 + w): HF checkpoints store w
(`norm_offset` 1), llama.cpp's converter writes 1 + w into the GGUF (offset 0). llama.cpp also stores the DeltaNet
value heads in tiled order (`DeltaNetDims.tiled`) and -exp(A_log) as `ssm_a`.

The multi-token-prediction (MTP) block the checkpoints carry is not part of the trunk: an HF checkpoint keeps it
under `mtp.*` (`mtp_num_hidden_layers`); llama.cpp's converter (unless run with `--no-mtp`) appends it as extra
blocks, counted in `block_count` and by `nextn_predict_layers`, and marks them non-recurrent in
`attention.recurrent_layers`. `ModelConfig.num_layers` counts the trunk's layers, `mtp_layers` the appended ones
(left in the file for MTP drafting).
"""

from __future__ import annotations

from typing import Any, Mapping

from edgeserve.errors import ModelLoadError, UnsupportedModelError
from edgeserve.kernels.torch.gated_delta import DeltaNetDims

from .config import ModelConfig, gguf_common_fields, gguf_key, gguf_trunk_layers, layer_flags


def _layer_pattern(layers: int, types: list[str] | None, interval: int,
                   recurrent: list[bool] | None = None) -> tuple[bool, ...]:
    """Per layer: True for a Gated DeltaNet layer, from HF `layer_types`, llama.cpp's per-block `recurrent` flags
    (which may list MTP blocks past `layers`), or else every layer but each `interval`-th."""
    if recurrent is not None:
        if len(recurrent) < layers:
            raise ModelLoadError(f"attention.recurrent_layers lists {len(recurrent)} layers, the model has {layers}")
        return tuple(bool(r) for r in recurrent[:layers])
    if types:
        return layer_flags(types, layers, "linear_attention", "full_attention", "Qwen3.5")
    if interval < 1:
        raise ModelLoadError(f"full_attention_interval must be positive, not {interval}")
    return tuple((i + 1) % interval != 0 for i in range(layers))


def qwen35_config_from_hf(arch: str, cfg: Mapping[str, Any]) -> ModelConfig:
    """A Qwen3.5 ModelConfig from an HF config.json dict (the text model's, or the multimodal one's text_config)."""
    if isinstance(cfg.get("text_config"), Mapping):
        cfg = cfg["text_config"]
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        rp = dict(cfg.get("rope_parameters") or {})
        if rp.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"Qwen3.5 RoPE type {rp.get('rope_type')!r} is not supported")
        partial = float(rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
        experts = int(cfg.get("num_experts") or 0) if arch == "qwen35moe" else 0
        moe = {}
        if experts:
            moe = dict(num_experts=experts, experts_per_token=int(cfg["num_experts_per_tok"]),
                       moe_intermediate_size=int(cfg["moe_intermediate_size"]), norm_topk_prob=True,
                       shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0))
        elif arch == "qwen35moe":
            raise ModelLoadError("a qwen3_5_moe config.json needs num_experts")
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rp.get("rope_theta", cfg.get("rope_theta", 10_000_000.0))),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 262_144)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            mtp_layers=int(cfg.get("mtp_num_hidden_layers") or 0),
            attention_bias=bool(cfg.get("attention_bias", False)),
            qk_norm=True,
            norm_offset=1.0,
            linear_layers=_layer_pattern(layers, cfg.get("layer_types"), int(cfg.get("full_attention_interval", 4))),
            delta=DeltaNetDims(int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"]),
                               int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"]),
                               int(cfg.get("linear_conv_kernel_dim", 4))),
            rotary_dim=_rotary_dim(head_dim, int(head_dim * partial)),
            attn_output_gate=True,
            **moe,
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json is missing {e.args[0]!r}") from None


def _rotary_dim(head_dim: int, rotary: int) -> int:
    if not 0 < rotary <= head_dim or rotary % 2:
        raise ModelLoadError(f"RoPE dimension {rotary} does not fit heads of {head_dim}")
    return rotary


def qwen35_config_from_gguf(arch: str, metadata: Mapping[str, Any], tensor_names: set[str]) -> ModelConfig:
    """A Qwen3.5 ModelConfig from llama.cpp's `qwen35.*` / `qwen35moe.*` metadata and the file's tensor names."""

    key = gguf_key(metadata, arch)

    layers, mtp = gguf_trunk_layers(metadata, arch)
    recurrent = metadata.get(f"{arch}.attention.recurrent_layers")
    v_heads = int(key("ssm.time_step_rank"))
    inner = int(key("ssm.inner_size"))
    if inner % v_heads:
        raise ModelLoadError(f"{arch}.ssm.inner_size {inner} is not a multiple of ssm.time_step_rank {v_heads}")
    delta = DeltaNetDims(int(key("ssm.group_count")), v_heads, int(key("ssm.state_size")), inner // v_heads,
                         int(key("ssm.conv_kernel", 4)), tiled=True)
    moe: dict[str, Any] = {}
    experts = int(metadata.get(f"{arch}.expert_count") or 0)
    if arch == "qwen35moe":
        if not experts:
            raise ModelLoadError(f"GGUF metadata is missing {arch}.expert_count")
        moe = dict(num_experts=experts, experts_per_token=int(key("expert_used_count")),
                   moe_intermediate_size=int(key("expert_feed_forward_length")), norm_topk_prob=True,
                   shared_expert_intermediate_size=int(metadata.get(f"{arch}.expert_shared_feed_forward_length")
                                                       or 0))
    elif experts:
        raise UnsupportedModelError(f"a {arch} GGUF with experts is not supported (use qwen35moe)")
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise UnsupportedModelError(f"RoPE scaling type {scaling!r} is not supported for {arch}")
    common = gguf_common_fields(metadata, arch, tensor_names, bool(moe), rope_theta=10_000_000.0, context=262_144)
    head_dim = common["head_dim"]
    return ModelConfig(
        architecture=arch,
        num_layers=layers,
        **common,
        qk_norm=True,
        linear_layers=_layer_pattern(layers, None, int(key("full_attention_interval", 4)),
                                     None if recurrent is None else list(recurrent)),
        delta=delta,
        rotary_dim=_rotary_dim(head_dim, int(key("rope.dimension_count", head_dim // 4))),
        attn_output_gate=True,
        mtp_layers=mtp,
        **moe,
    )
