"""ModelConfig: the shape of a decoder, read from GGUF metadata or an HF config.json.

The shared keys (sizes, heads, norms, RoPE, experts) are read here once; each architecture's package
(edgeserve.models.registry) adds its own fields on top (`fields_from_gguf` / `fields_from_hf` in its config.py) or,
for a block unlike Llama's, reads the whole config itself (`config_from_gguf` / `config_from_hf`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

from edgeserve.errors import ModelLoadError, UnsupportedModelError
from edgeserve.kernels.torch.gated_delta import DeltaNetDims

from .registry import HF_WRAPPERS, Architecture, architecture, gguf_architecture, hf_class, hf_model_type, \
    names_declaring

@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: 'linear', 'llama3', 'longrope' or 'yarn' (HF `rope_scaling`; for longrope `factor` is
    the cos/sin attention factor, 1.0 meaning "derive it from the context lengths")."""

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factors: tuple[float, ...] = ()  # longrope's per-frequency divisors up to the original context
    # yarn: the ramp between interpolated and kept frequencies, and the cos/sin factor (None: 0.1 ln(factor) + 1)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None


@dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder needs to know about a model's shape."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # qwen2: bias on q/k/v projections
    qk_norm: bool = False  # qwen3: RMSNorm on q and k per head
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None  # one window for every layer (mistral); caps the context
    # issue 33's Llama-family variants (models.archs.llama, models.archs.olmo2): SmolLM3, OLMo 2/3, Ministral 3, Granite
    rope_layers: tuple[bool, ...] | None = None  # per layer: whether it applies RoPE (SmolLM3's NoPE); None: all
    post_norms: bool = False  # OLMo 2: RMSNorm after attention and after the MLP, none before (models.archs.olmo2)
    qk_norm_full: bool = False  # OLMo 2: the Q/K RMSNorm spans the whole projection, not each head
    attn_temperature: float = 0.0  # Ministral 3: queries times 1 + this * ln(1 + floor(pos / length)); 0: none
    attn_temperature_length: int = 0
    residual_scale: float = 1.0  # Granite: attention and MLP outputs times this before each residual add
    logit_scale: float = 1.0  # Granite: output logits divided by this
    # Qwen3-VL's M-RoPE (edgeserve.models.mrope): rotary pairs per (t, h, w) axis, interleaved; None: 1-D RoPE
    mrope_sections: tuple[int, ...] | None = None
    mrope_interleaved: bool = False
    # Gemma's block (defaults: the Llama one)
    activation: str = "silu"  # "silu" or "gelu_tanh", of the gated MLP
    norm_offset: float = 0.0  # added to stored RMSNorm weights at load (HF Gemma stores w for a (1 + w) norm)
    sandwich_norms: bool = False  # RMSNorm after attention and after the MLP too, before each residual add
    embed_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden_size))
    layer_windows: tuple[int | None, ...] | None = None  # per layer: its sliding window, None for global layers
    rope_local_theta: float | None = None  # RoPE base of the sliding-window layers (Gemma 3)
    query_scale: float | None = None  # attention scale when not head_dim ** -0.5
    attn_softcap: float | None = None  # attention-logit soft-capping (Gemma 2)
    final_softcap: float | None = None  # output-logit soft-capping (Gemma 2)
    # Gemma 4's block (edgeserve.models.archs.gemma4); `head_dim` / `num_kv_heads` are then the sliding layers'
    global_head_dim: int | None = None  # head size of the global (full-attention) layers
    global_kv_heads: int | None = None  # K/V heads of the global layers
    global_k_eq_v: bool = False  # the global layers have no V projection: V is K (before K's norm and RoPE)
    rope_global_partial: float = 1.0  # fraction of a global head that RoPE rotates ("proportional" RoPE)
    kv_shared_layers: int = 0  # the last this many layers read an earlier layer's K/V and keep none
    per_layer_input_size: int = 0  # per-layer embeddings (PLE) width per layer; 0: none
    layer_intermediate: tuple[int, ...] | None = None  # per layer MLP width where it varies (double-wide MLP)
    # Mixture-of-Experts feed-forward (edgeserve.models.moe; num_experts 0: a dense MLP)
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0  # each expert's
    norm_topk_prob: bool = False  # rescale the chosen experts' weights to sum to 1
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    routed_scaling_factor: float = 1.0  # the chosen experts' weights times this (Nemotron-H MoE)
    # gpt-oss (edgeserve.models.archs.gpt_oss): clamped SwiGLU experts (kernels.torch.activation.swiglu_oai)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # hybrids (edgeserve.models.qwen35): per layer, whether it is a Gated DeltaNet layer (no KV, a recurrent
    # state) rather than full attention; the DeltaNet layers' shape; partial RoPE; attention output gate
    linear_layers: tuple[bool, ...] | None = None
    delta: DeltaNetDims | None = None
    # what each of those layers keeps per sequence when not Gated DeltaNet's state (an engine.cache.state_pool
    # LayerStateKind: LFM2's short convolution's conv state); None: `delta`'s
    state_kind: Any = None
    # per layer: keeps neither KV nor a state (Nemotron-H's MLP-only blocks); None: every layer has a mixer
    mixerless_layers: tuple[bool, ...] | None = None
    # every state layer attends over its own K/V too (Falcon-H1: attention and Mamba-2 side by side in each layer)
    attention_beside_state: bool = False
    # HF tensors to scale at load, by name suffix, as llama.cpp's converter folds them into the GGUF (Falcon-H1's
    # multipliers): a scale, or per-segment scales of the rows (segment sizes, scales)
    folded_scales: tuple[tuple[str, Any], ...] = ()
    rotary_dim: int | None = None  # RoPE rotates only the first rotary_dim dims of each head (None: all)
    attn_output_gate: bool = False  # q_proj doubled per head: [q | gate], output times sigmoid(gate)
    # multi-token-prediction (MTP / nextn) blocks the file carries after the trunk, not run by the trunk: in a GGUF
    # `blk.{num_layers + i}` (nextn.* tensors beside a layer's), in an HF checkpoint `mtp.*`
    mtp_layers: int = 0
    # a drafter over another model's K/V (a Gemma 4 assistant, models.archs.gemma4_assistant): that target's hidden
    # size, which its input and output projections have; 0: a model of its own
    backbone_hidden_size: int = 0
    # its head's centroid mask (E2B / E4B assistants' `use_ordered_embeddings`): logits of the tokens of the top this
    # many of `masked_embedding`'s centroids only; 0: the whole head
    head_top_centroids: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers keep a recurrent state instead of KV (Gated DeltaNet, a short convolution)."""
        return bool(self.linear_layers) and any(self.linear_layers)

    def is_linear(self, layer: int) -> bool:
        """Whether `layer` is a state layer (Gated DeltaNet, a short convolution): no KV of its own."""
        return bool(self.linear_layers) and self.linear_layers[layer]

    def keeps_kv(self, layer: int) -> bool:
        """Whether `layer` attends over K/V (not a state layer unless `attention_beside_state`, not a mixerless MLP
        block)."""
        if self.is_linear(layer):
            return self.attention_beside_state
        return not (self.mixerless_layers and self.mixerless_layers[layer])

    @property
    def num_linear_layers(self) -> int:
        return sum(self.linear_layers or ())

    @property
    def layer_state(self) -> Any:
        """What one state layer of a hybrid keeps per sequence, as `engine.cache.state_pool.StateSpec` takes it: its
        `state_kind`, else the Gated DeltaNet shape `delta`."""
        return self.state_kind if self.state_kind is not None else self.delta

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_global(self, layer: int) -> bool:
        """Whether `layer` attends to the whole context (not a sliding-window layer)."""
        return self.layer_windows is None or self.layer_windows[layer] is None

    def layer_head_dim(self, layer: int) -> int:
        """The head size of `layer` (Gemma 4's global layers have their own)."""
        return self.global_head_dim if self.global_head_dim and self.is_global(layer) else self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        """The K/V head count of `layer`."""
        return self.global_kv_heads if self.global_kv_heads and self.is_global(layer) else self.num_kv_heads

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V `layer` attends over: itself, or for one of the last `kv_shared_layers` layers the
        last earlier layer of its kind (sliding or global) that keeps its own."""
        first_shared = self.num_layers - self.kv_shared_layers
        if layer < first_shared:
            return layer
        kind = self.is_global(layer)
        for j in range(first_shared - 1, -1, -1):
            if self.is_global(j) == kind:
                return j
        raise ValueError(f"layer {layer} shares K/V but no earlier layer of its kind keeps any")


def gguf_key(metadata: Mapping[str, Any], arch: str) -> Callable[..., Any]:
    """key(name, default=None): the GGUF metadata value `<arch>.<name>`, or `default`; a ModelLoadError naming the
    key when both are missing."""

    def key(name: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata is missing {arch}.{name}")
        return value

    return key


def layer_flags(types: list[str], layers: int, marked: str, other: str, family: str) -> tuple[bool, ...]:
    """Per layer: True where HF's `layer_types` says `marked` (False where `other`); a one-line error when it lists
    another number of layers than `layers` or a type that is neither."""
    if len(types) != layers:
        raise ModelLoadError(f"layer_types lists {len(types)} layers, the model has {layers}")
    unknown = set(types) - {marked, other}
    if unknown:
        raise UnsupportedModelError(f"{family} layer types {sorted(unknown)} are not supported")
    return tuple(t == marked for t in types)


def gguf_trunk_layers(metadata: Mapping[str, Any], arch: str) -> tuple[int, int]:
    """(trunk layers, MTP layers) of a GGUF: llama.cpp's converters append a model's multi-token-prediction blocks
    after the trunk, counted in `block_count` and by `nextn_predict_layers`."""
    blocks = int(gguf_key(metadata, arch)("block_count"))
    mtp = int(metadata.get(f"{arch}.nextn_predict_layers") or 0)
    if not 0 <= mtp < blocks:
        raise ModelLoadError(f"{arch}.nextn_predict_layers {mtp} does not fit block_count {blocks}")
    return blocks - mtp, mtp


def gguf_vocab_size(metadata: Mapping[str, Any], arch: str) -> int:
    """The vocabulary size a GGUF gives: `{arch}.vocab_size`, else the tokenizer's token count."""
    vocab = metadata.get(f"{arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens") or ())
    if not vocab:
        raise ModelLoadError("GGUF metadata has neither a vocab_size nor tokenizer tokens")
    return int(vocab)


def config_from_gguf(metadata: Mapping[str, Any], tensor_names: set[str]) -> ModelConfig:
    """Build a ModelConfig from GGUF metadata (`{arch}.*` keys) and the file's tensor names."""
    name = metadata.get("general.architecture")
    if not isinstance(name, str):
        raise ModelLoadError("GGUF metadata has no general.architecture")
    spec = gguf_architecture(name)
    arch = spec.name
    if name != arch:  # an alias (EmbeddingGemma's gemma-embedding): its keys read under the architecture's name
        metadata = {arch + "." + k.removeprefix(name + ".") if k.startswith(name + ".") else k: v
                    for k, v in metadata.items()}
    whole = spec.config_hook("config_from_gguf")
    if whole is not None:
        return whole(arch, metadata, tensor_names)
    config = _shared_from_gguf(spec, metadata, tensor_names)
    own = spec.config_hook("fields_from_gguf")
    fields = own(config, metadata, tensor_names) if own is not None else {}
    return replace(config, **fields) if fields else config


def _shared_from_gguf(spec: Architecture, metadata: Mapping[str, Any], tensor_names: set[str]) -> ModelConfig:
    """The ModelConfig fields every architecture reads from the same GGUF keys."""
    arch = spec.name
    # llama-3 scaling is stored in GGUF as a `rope_freqs.weight` tensor of per-frequency factors.
    layers, mtp = gguf_trunk_layers(metadata, arch)
    moe = _moe_from_gguf(spec, metadata)
    return ModelConfig(
        architecture=arch,
        num_layers=layers,
        mtp_layers=mtp,
        **gguf_common_fields(metadata, arch, tensor_names, bool(moe), rope_theta=10000.0, context=4096),
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        rope_scaling=_rope_scaling_from_gguf(spec, metadata, tensor_names),
        **moe,
    )


def gguf_common_fields(metadata: Mapping[str, Any], arch: str, tensor_names: set[str], moe: bool, rope_theta: float,
                       context: int) -> dict[str, Any]:
    """The ModelConfig fields every GGUF states under the same `{arch}.*` keys: sizes, heads, norm epsilon, RoPE base
    and context (`rope_theta` / `context` where the file is silent), and whether the head is tied (no
    `output.weight`); with `moe` a missing feed_forward_length is 0."""
    key = gguf_key(metadata, arch)
    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    return dict(
        vocab_size=int(gguf_vocab_size(metadata, arch)),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length", 0 if moe else None)),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(metadata.get(f"{arch}.attention.key_length") or hidden // heads),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", rope_theta)),
        max_position_embeddings=int(key("context_length", context)),
        tie_word_embeddings="output.weight" not in tensor_names,
    )


def _rope_scaling_from_gguf(spec: Architecture, metadata: Mapping[str, Any],
                            tensor_names: set[str]) -> RopeScaling | None:
    """RoPE scaling from `{arch}.rope.scaling.*`: linear, YaRN, or the architecture's own (Phi-3's longrope)."""
    arch = spec.name
    scaling_type = metadata.get(f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        return RopeScaling("linear", factor=float(gguf_key(metadata, arch)("rope.scaling.factor")))
    if scaling_type == "yarn":
        return _yarn_from_gguf(arch, metadata)
    own = spec.config_hook("rope_scaling_from_gguf")
    scaling = own(arch, metadata, tensor_names) if own is not None else None
    if scaling is None and scaling_type not in (None, "none"):
        raise UnsupportedModelError(f"RoPE scaling type {scaling_type!r} is not supported")
    return scaling


def _yarn_from_gguf(arch: str, metadata: Mapping[str, Any]) -> RopeScaling:
    """YaRN from `{arch}.rope.scaling.*` (factor, original_context_length, and the optional yarn_beta_fast /
    yarn_beta_slow / yarn_attn_factor llama.cpp's converters write for some models). An architecture trained with
    the ramp's ends not rounded (HF `truncate: false`; gpt-oss), which its GGUF does not record, declares
    YARN_UNTRUNCATED."""
    def get(name: str) -> Any:
        return metadata.get(f"{arch}.rope.scaling.{name}")

    factor, original = get("factor"), get("original_context_length")
    if factor is None or original is None:
        raise ModelLoadError(f"GGUF YaRN scaling needs {arch}.rope.scaling.factor and .original_context_length")
    return RopeScaling("yarn", factor=float(factor), original_max_position_embeddings=int(original),
                       beta_fast=float(get("yarn_beta_fast") or 32.0), beta_slow=float(get("yarn_beta_slow") or 1.0),
                       truncate=not architecture(arch).declared("YARN_UNTRUNCATED", False),
                       attention_factor=float(get("yarn_attn_factor")) if get("yarn_attn_factor") else None)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude scale for a context `factor` (transformers' get_mscale)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def yarn_attention_factor_from_hf(rs: Mapping[str, Any]) -> float | None:
    """YaRN's cos/sin factor as transformers derives it: `attention_factor` when given, else from `mscale` and
    `mscale_all_dim` when both are (Ministral 3: 1.0), else None (the default 0.1 ln(factor) + 1)."""
    if rs.get("attention_factor"):
        return float(rs["attention_factor"])
    mscale, all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
    if mscale and all_dim:
        factor = float(rs["factor"])
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(all_dim))
    return None


def with_yarn_attention_factor(config: ModelConfig, factor: float | None) -> dict[str, Any]:
    """The `rope_scaling` field of `config` with YaRN's cos/sin factor set to `factor` (empty when there is none or
    the scaling is not YaRN)."""
    scaling = config.rope_scaling
    if factor is None or scaling is None or scaling.kind != "yarn":
        return {}
    return dict(rope_scaling=replace(scaling, attention_factor=factor))


def _moe_from_gguf(spec: Architecture, metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The Mixture-of-Experts fields of a ModelConfig from GGUF metadata (empty for a dense model)."""
    arch = spec.name
    experts = int(metadata.get(f"{arch}.expert_count") or 0)
    if not experts:
        return {}
    _check_moe_architecture(spec, experts)
    used = metadata.get(f"{arch}.expert_used_count")
    ffn = metadata.get(f"{arch}.expert_feed_forward_length")
    if used is None or ffn is None:
        raise ModelLoadError(f"GGUF metadata of a {experts}-expert model is missing {arch}.expert_used_count or "
                             f"{arch}.expert_feed_forward_length")
    # llama.cpp renormalizes the chosen weights of qwen3moe without a key saying so (SOFTMAX_TOPK)
    norm = metadata.get(f"{arch}.expert_weights_norm", spec.declared("SOFTMAX_TOPK", False))
    return dict(num_experts=experts, experts_per_token=int(used), moe_intermediate_size=int(ffn),
                norm_topk_prob=bool(norm),
                shared_expert_intermediate_size=int(metadata.get(f"{arch}.expert_shared_feed_forward_length") or 0))


def _check_moe_architecture(spec: Architecture, experts: int) -> None:
    """Refuse experts in an architecture whose package does not declare EXPERTS (a Mixtral GGUF, llama with
    ffn_*_exps) by name."""
    if not spec.declared("EXPERTS", False):
        raise UnsupportedModelError(f"{spec.name!r} models with experts ({experts}) are not supported "
                                    f"(Mixture-of-Experts architectures: {', '.join(names_declaring('EXPERTS'))})")


def _moe_from_hf(spec: Architecture, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The Mixture-of-Experts fields of a ModelConfig from an HF config (empty for a dense model)."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if not experts:
        return {}
    _check_moe_architecture(spec, experts)
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step") or 1) != 1:
        raise UnsupportedModelError("MoE models with dense MLP layers among the expert layers (mlp_only_layers, "
                                    "decoder_sparse_step) are not supported")
    return dict(num_experts=experts, experts_per_token=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0))


def hf_architecture(cfg: Mapping[str, Any]) -> tuple[Architecture, Mapping[str, Any]]:
    """The registered architecture an HF config names (its model_type, else its class), with the config of its
    language model (a wrapper's `text_config`, or the architecture's own `text_config` hook)."""
    arch = cfg.get("model_type")
    if arch is None and cfg.get("architectures"):
        arch = hf_class(cfg["architectures"][0])
    if arch in HF_WRAPPERS and isinstance(cfg.get("text_config"), Mapping):  # SmolVLM: a Llama inside
        text = cfg["text_config"]
        cfg = {**text, "tie_word_embeddings": cfg.get("tie_word_embeddings", text.get("tie_word_embeddings"))}
        arch = str(text.get("model_type") or "llama")
    if not isinstance(arch, str):
        raise ModelLoadError("config.json has no model_type or architectures")
    spec = architecture(hf_model_type(arch))
    text_config = spec.config_hook("text_config")
    return spec, text_config(spec.name, cfg) if text_config is not None else cfg


def multimodal_text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a multimodal HF config (its `text_config`, with the top config's
    tie_word_embeddings), else `cfg` itself."""
    if not isinstance(cfg.get("text_config"), Mapping):
        return cfg
    text = cfg["text_config"]
    return {**text, "tie_word_embeddings": cfg.get("tie_word_embeddings", text.get("tie_word_embeddings"))}


def config_from_hf(cfg: Mapping[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face `config.json` dict."""
    spec, cfg = hf_architecture(cfg)
    whole = spec.config_hook("config_from_hf")
    if whole is not None:
        return whole(spec.name, cfg)
    try:
        config = _shared_from_hf(spec, cfg)
        own = spec.config_hook("fields_from_hf")
        fields = own(config, cfg) if own is not None else {}
        return replace(config, **fields) if fields else config
    except KeyError as e:
        raise ModelLoadError(f"config.json is missing {e.args[0]!r}") from None


def _shared_from_hf(spec: Architecture, cfg: Mapping[str, Any]) -> ModelConfig:
    """The ModelConfig fields every architecture reads from the same HF config keys."""
    arch = spec.name
    moe = _moe_from_hf(spec, cfg)
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    partial = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0) and not spec.declared("PARTIAL_ROTARY", False):  # Phi-4-mini: models.archs.phi3
        raise UnsupportedModelError(f"partial rotary embeddings (partial_rotary_factor {partial}) are not supported")
    rope_theta = cfg.get("rope_theta")
    if rope_theta is None:  # newer transformers nest it under rope_parameters
        rp = cfg.get("rope_parameters") or {}
        rope_theta = (rp.get("full_attention") or rp).get("rope_theta", 10000.0)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg.get("intermediate_size") or 0) if moe else int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        rope_scaling=_rope_scaling_from_hf(spec, cfg),
        sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None,
        rotary_dim=int(int(cfg.get("head_dim") or hidden // heads) * float(partial))
        if partial not in (None, 1, 1.0) else None,
        **moe,
    )


def _rope_scaling_from_hf(spec: Architecture, cfg: Mapping[str, Any]) -> RopeScaling | None:
    """RoPE scaling from HF `rope_scaling` (transformers < 5) or `rope_parameters` (5.x, which also holds
    rope_theta): linear, llama3, YaRN, or longrope where the architecture declares LONGROPE (Phi-3)."""
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or None
    if rs and isinstance(rs.get("full_attention"), Mapping):  # per layer type (Gemma 3): the global layers'
        rs = rs["full_attention"]
    if not rs:
        return None
    kind = rs.get("rope_type") or rs.get("type")
    if kind == "linear":
        return RopeScaling("linear", factor=float(rs["factor"]))
    if kind == "llama3":
        return RopeScaling("llama3", factor=float(rs["factor"]), low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
                           high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
                           original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)))
    if kind in ("longrope", "su") and spec.declared("LONGROPE", False):
        return RopeScaling("longrope", factor=float(rs.get("attention_factor") or 1.0),
                           original_max_position_embeddings=int(cfg.get("original_max_position_embeddings")
                                                                or rs.get("original_max_position_embeddings")),
                           short_factors=tuple(float(f) for f in rs["short_factor"]))
    if kind == "yarn":
        return RopeScaling("yarn", factor=float(rs["factor"]),
                           original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
                           beta_fast=float(rs.get("beta_fast") or 32.0), beta_slow=float(rs.get("beta_slow") or 1.0),
                           truncate=bool(rs.get("truncate", True)), attention_factor=yarn_attention_factor_from_hf(rs))
    if kind not in ("default", None):
        raise UnsupportedModelError(f"RoPE scaling type {kind!r} is not supported")
    return None
