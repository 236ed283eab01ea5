"""ModelConfig: the shape of a Llama-family decoder, read from GGUF metadata or an HF config.json."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

from edgeserve.errors import ModelLoadError, UnsupportedModelError
from edgeserve.kernels.gated_delta import DeltaNetDims

from .variants import (VARIANT_ARCHITECTURES, VARIANT_HF_CLASSES, VARIANT_HF_MODEL_TYPES, variant_fields_from_gguf,
                       variant_fields_from_hf, variant_text_config, yarn_attention_factor_from_gguf,
                       yarn_attention_factor_from_hf)

# GGUF `general.architecture` / HF `model_type` values this decoder implements.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma4", "phi3", "qwen3moe",
                           "gpt-oss", "qwen35", "qwen35moe")
# Hybrid architectures (edgeserve.models.qwen35): Gated DeltaNet layers with a recurrent state beside attention.
HYBRID_ARCHITECTURES = ("qwen35", "qwen35moe")
# Architectures with Gemma's block (edgeserve.models.gemma); the rest run the Llama decoder.
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
# HF `model_type` spellings of our architecture names.
HF_MODEL_TYPES = {"gemma3_text": "gemma3", "gemma4_text": "gemma4", "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss",
                  "qwen3_5": "qwen35", "qwen3_5_text": "qwen35", "qwen3_5_moe": "qwen35moe",
                  "qwen3_5_moe_text": "qwen35moe"}
# HF `architectures[0]` class names mapped to our architecture names.
HF_CLASS_TO_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma4ForCausalLM": "gemma4",
    "Gemma4ForConditionalGeneration": "gemma4",
    "Phi3ForCausalLM": "phi3",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "GptOssForCausalLM": "gpt-oss",
    "Qwen3_5ForCausalLM": "qwen35",
    "Qwen3_5ForConditionalGeneration": "qwen35",
    "Qwen3_5MoeForCausalLM": "qwen35moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen35moe",
}
# Architectures whose feed-forward may be a Mixture-of-Experts layer (edgeserve.models.moe); experts in any other
# architecture (e.g. a Mixtral GGUF, llama with ffn_*_exps) are refused by name.
MOE_ARCHITECTURES = ("qwen3moe", "gpt-oss", "qwen35moe")
# Mixture-of-Experts architectures whose MoE layers route with a softmax over all experts, then the top k.
SOFTMAX_TOPK_ARCHITECTURES = ("qwen3moe", "qwen35moe")


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
    # issue 33's Llama-family variants (edgeserve.models.variants): SmolLM3, OLMo 2/3, Ministral 3, Granite
    rope_layers: tuple[bool, ...] | None = None  # per layer: whether it applies RoPE (SmolLM3's NoPE); None: all
    post_norms: bool = False  # OLMo 2: RMSNorm after attention and after the MLP, none before (models.olmo2)
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
    # Gemma 4's block (edgeserve.models.gemma4); `head_dim` / `num_kv_heads` are then the sliding layers'
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
    # gpt-oss (edgeserve.models.gpt_oss): clamped SwiGLU experts (kernels.activation.swiglu_oai)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # hybrids (edgeserve.models.qwen35): per layer, whether it is a Gated DeltaNet layer (no KV, a recurrent
    # state) rather than full attention; the DeltaNet layers' shape; partial RoPE; attention output gate
    linear_layers: tuple[bool, ...] | None = None
    delta: DeltaNetDims | None = None
    rotary_dim: int | None = None  # RoPE rotates only the first rotary_dim dims of each head (None: all)
    attn_output_gate: bool = False  # q_proj doubled per head: [q | gate], output times sigmoid(gate)
    # multi-token-prediction (MTP / nextn) blocks the file carries after the trunk, not run by the trunk: in a GGUF
    # `blk.{num_layers + i}` (nextn.* tensors beside a layer's), in an HF checkpoint `mtp.*`
    mtp_layers: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers keep a recurrent state instead of KV (Gated DeltaNet)."""
        return bool(self.linear_layers) and any(self.linear_layers)

    def is_linear(self, layer: int) -> bool:
        """Whether `layer` is a linear-attention (Gated DeltaNet) layer: no KV of its own."""
        return bool(self.linear_layers) and self.linear_layers[layer]

    @property
    def num_linear_layers(self) -> int:
        return sum(self.linear_layers or ())

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


def gguf_trunk_layers(metadata: Mapping[str, Any], arch: str) -> tuple[int, int]:
    """(trunk layers, MTP layers) of a GGUF: llama.cpp's converters append a model's multi-token-prediction blocks
    after the trunk, counted in `block_count` and by `nextn_predict_layers`."""
    blocks = int(gguf_key(metadata, arch)("block_count"))
    mtp = int(metadata.get(f"{arch}.nextn_predict_layers") or 0)
    if not 0 <= mtp < blocks:
        raise ModelLoadError(f"{arch}.nextn_predict_layers {mtp} does not fit block_count {blocks}")
    return blocks - mtp, mtp


def check_architecture(arch: str) -> str:
    """Return `arch` if supported, else refuse it by name."""
    supported = SUPPORTED_ARCHITECTURES + VARIANT_ARCHITECTURES
    if arch not in supported:
        raise UnsupportedModelError(f"architecture {arch!r} is not supported (supported: {', '.join(supported)})")
    return arch


def config_from_gguf(metadata: Mapping[str, Any], tensor_names: set[str]) -> ModelConfig:
    """Build a ModelConfig from GGUF metadata (`{arch}.*` keys) and the file's tensor names."""
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError("GGUF metadata has no general.architecture")
    if arch == "gemma-embedding":  # EmbeddingGemma: a Gemma 3 body (decoder_embed makes its attention bidirectional)
        metadata = {"gemma3." + k.removeprefix("gemma-embedding.") if k.startswith("gemma-embedding.") else k: v
                    for k, v in metadata.items()}
        arch = "gemma3"
    check_architecture(arch)
    if arch == "gemma4":
        from .gemma4_config import gemma4_config_from_gguf

        return gemma4_config_from_gguf(metadata, tensor_names)
    if arch in HYBRID_ARCHITECTURES:
        from .qwen35_config import qwen35_config_from_gguf

        return qwen35_config_from_gguf(arch, metadata, tensor_names)

    key = gguf_key(metadata, arch)

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv_heads = int(key("attention.head_count_kv", heads))
    head_dim = int(metadata.get(f"{arch}.attention.key_length") or hidden // heads)
    vocab = metadata.get(f"{arch}.vocab_size")
    if vocab is None:
        tokens = metadata.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ModelLoadError("GGUF metadata has neither a vocab_size nor tokenizer tokens")
        vocab = len(tokens)
    scaling = None
    scaling_type = metadata.get(f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        scaling = RopeScaling("linear", factor=float(key("rope.scaling.factor")))
    elif scaling_type == "yarn":
        scaling = _yarn_from_gguf(arch, metadata)
    elif arch == "phi3" and "rope_factors_short.weight" in tensor_names:  # longrope, its factors as tensors
        scaling = RopeScaling("longrope", factor=float(metadata.get(f"{arch}.rope.scaling.attn_factor") or 1.0),
                              original_max_position_embeddings=int(key("rope.scaling.original_context_length")))
    elif scaling_type not in (None, "none"):
        raise UnsupportedModelError(f"RoPE scaling type {scaling_type!r} is not supported")
    # llama-3 scaling is stored in GGUF as a `rope_freqs.weight` tensor of per-frequency factors.
    layers, mtp = gguf_trunk_layers(metadata, arch)
    gemma = _gemma_from_gguf(arch, metadata, layers, hidden, heads, head_dim)
    gemma.update(_gpt_oss_from_gguf(arch, metadata, layers))
    moe = _moe_from_gguf(arch, metadata)
    config = ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length", 0 if moe else None)),
        num_layers=layers,
        mtp_layers=mtp,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        rope_scaling=scaling,
        sliding_window=int(metadata[f"{arch}.attention.sliding_window"])
        if arch == "phi3" and metadata.get(f"{arch}.attention.sliding_window") else None,
        rotary_dim=int(metadata[f"{arch}.rope.dimension_count"]) if arch == "phi3" and int(
            metadata.get(f"{arch}.rope.dimension_count") or head_dim) < head_dim else None,
        **gemma,
        **moe,
    )
    return _with_variant_gguf(config, metadata, tensor_names)


def _with_variant_gguf(config: ModelConfig, metadata: Mapping[str, Any], tensor_names: set[str]) -> ModelConfig:
    """`config` with the fields of issue 33's variants (edgeserve.models.variants) read from GGUF metadata."""
    arch = config.architecture
    fields = variant_fields_from_gguf(arch, metadata, config.num_layers, tensor_names)
    factor = yarn_attention_factor_from_gguf(arch, metadata)
    if factor is not None and config.rope_scaling is not None and config.rope_scaling.kind == "yarn":
        fields["rope_scaling"] = replace(config.rope_scaling, attention_factor=factor)
    return replace(config, **fields) if fields else config


def _yarn_from_gguf(arch: str, metadata: Mapping[str, Any]) -> RopeScaling:
    """YaRN from `{arch}.rope.scaling.*` (factor, original_context_length, and the optional yarn_beta_fast /
    yarn_beta_slow / yarn_attn_factor llama.cpp's converters write for some models). gpt-oss was trained with the
    ramp's ends not rounded (HF `truncate: false`), which its GGUF does not record."""
    def get(name: str) -> Any:
        return metadata.get(f"{arch}.rope.scaling.{name}")

    factor, original = get("factor"), get("original_context_length")
    if factor is None or original is None:
        raise ModelLoadError(f"GGUF YaRN scaling needs {arch}.rope.scaling.factor and .original_context_length")
    return RopeScaling("yarn", factor=float(factor), original_max_position_embeddings=int(original),
                       beta_fast=float(get("yarn_beta_fast") or 32.0), beta_slow=float(get("yarn_beta_slow") or 1.0),
                       truncate=arch != "gpt-oss",
                       attention_factor=float(get("yarn_attn_factor")) if get("yarn_attn_factor") else None)


def _gpt_oss_windows(window: int | None, sliding: list[bool]) -> dict[str, Any]:
    """gpt-oss's per-layer windows: `window` on the sliding layers, full attention on the others."""
    return dict(layer_windows=tuple(int(window) if s and window else None for s in sliding))


def _gpt_oss_from_gguf(arch: str, metadata: Mapping[str, Any], layers: int) -> dict[str, Any]:
    """gpt-oss's fields from GGUF metadata (empty for other architectures): llama.cpp slides the even layers
    (a pattern of 2, as HF's default layer_types)."""
    if arch != "gpt-oss":
        return {}
    window = metadata.get(f"{arch}.attention.sliding_window")
    return _gpt_oss_windows(window, [i % 2 == 0 for i in range(layers)])


def _gpt_oss_from_hf(arch: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """gpt-oss's fields from an HF config (empty for other architectures)."""
    if arch != "gpt-oss":
        return {}
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    fields = _gpt_oss_windows(cfg.get("sliding_window"), [t == "sliding_attention" for t in types])
    fields.update(swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)), swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))
    return fields


def _moe_from_gguf(arch: str, metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The Mixture-of-Experts fields of a ModelConfig from GGUF metadata (empty for a dense model)."""
    experts = int(metadata.get(f"{arch}.expert_count") or 0)
    if not experts:
        return {}
    _check_moe_architecture(arch, experts)
    used = metadata.get(f"{arch}.expert_used_count")
    ffn = metadata.get(f"{arch}.expert_feed_forward_length")
    if used is None or ffn is None:
        raise ModelLoadError(f"GGUF metadata of a {experts}-expert model is missing {arch}.expert_used_count or "
                             f"{arch}.expert_feed_forward_length")
    # llama.cpp renormalizes the chosen weights of qwen3moe without a key saying so
    norm = metadata.get(f"{arch}.expert_weights_norm", arch in SOFTMAX_TOPK_ARCHITECTURES)
    return dict(num_experts=experts, experts_per_token=int(used), moe_intermediate_size=int(ffn),
                norm_topk_prob=bool(norm),
                shared_expert_intermediate_size=int(metadata.get(f"{arch}.expert_shared_feed_forward_length") or 0))


def _check_moe_architecture(arch: str, experts: int) -> None:
    if arch not in MOE_ARCHITECTURES:
        raise UnsupportedModelError(f"{arch!r} models with experts ({experts}) are not supported (Mixture-of-Experts "
                                    f"architectures: {', '.join(MOE_ARCHITECTURES)})")


def _moe_from_hf(arch: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The Mixture-of-Experts fields of a ModelConfig from an HF config (empty for a dense model)."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if not experts:
        return {}
    _check_moe_architecture(arch, experts)
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step") or 1) != 1:
        raise UnsupportedModelError("MoE models with dense MLP layers among the expert layers (mlp_only_layers, "
                                    "decoder_sparse_step) are not supported")
    return dict(num_experts=experts, experts_per_token=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0))


# llama.cpp's sliding-window layer patterns: layer i is global when (i + 1) % pattern == 0
_GEMMA_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}


def _gemma_from_gguf(arch: str, metadata: Mapping[str, Any], layers: int, hidden: int, heads: int,
                     head_dim: int) -> dict[str, Any]:
    """The Gemma-block fields of a ModelConfig from GGUF metadata (empty for other architectures).
    GGUF converters store Gemma's norm weights as 1 + w already, so no norm offset here."""
    if arch not in GEMMA_ARCHITECTURES:
        return {}
    window = metadata.get(f"{arch}.attention.sliding_window")
    pattern = _GEMMA_SWA_PATTERN[arch]
    windows = tuple(None if window is None or (i + 1) % pattern == 0 else int(window) for i in range(layers))
    # llama.cpp: the 27B models scale queries by (hidden / heads) ** -0.5, the others by head_dim ** -0.5
    big = (arch == "gemma2" and layers == 46) or (arch == "gemma3" and layers == 62)
    fields: dict[str, Any] = dict(
        activation="gelu_tanh", sandwich_norms=True, embed_scale=hidden ** 0.5, layer_windows=windows,
        query_scale=(hidden // heads) ** -0.5 if big else head_dim ** -0.5,
        attn_softcap=_positive(metadata.get(f"{arch}.attn_logit_softcapping")),
        final_softcap=_positive(metadata.get(f"{arch}.final_logit_softcapping")),
    )
    if arch == "gemma3":
        fields["rope_local_theta"] = float(metadata.get(f"{arch}.rope.freq_base_swa", 10000.0))
    return fields


def _positive(value: Any) -> float | None:
    return float(value) if value else None


def _gemma_from_hf(arch: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The Gemma-block fields of a ModelConfig from an HF config (empty for other architectures)."""
    if arch not in GEMMA_ARCHITECTURES:
        return {}
    layers = int(cfg["num_hidden_layers"])
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if not types:
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or _GEMMA_SWA_PATTERN[arch])
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    windows = tuple(int(window) if t == "sliding_attention" and window else None for t in types)
    fields: dict[str, Any] = dict(
        activation="gelu_tanh", norm_offset=1.0, sandwich_norms=True, embed_scale=int(cfg["hidden_size"]) ** 0.5,
        layer_windows=windows, query_scale=float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim")) ** -0.5,
        attn_softcap=_positive(cfg.get("attn_logit_softcapping")),
        final_softcap=_positive(cfg.get("final_logit_softcapping")),
    )
    if arch == "gemma3":
        rp = cfg.get("rope_parameters") or {}
        local = rp.get("sliding_attention") or {}
        fields["rope_local_theta"] = float(cfg.get("rope_local_base_freq") or local.get("rope_theta") or 10000.0)
    return fields


def config_from_hf(cfg: Mapping[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face `config.json` dict."""
    arch = cfg.get("model_type")
    if arch is None and cfg.get("architectures"):
        arch = HF_CLASS_TO_ARCH.get(cfg["architectures"][0], cfg["architectures"][0])
        arch = VARIANT_HF_CLASSES.get(arch, arch)
    if arch == "gemma3" and isinstance(cfg.get("text_config"), Mapping):
        cfg = {**cfg["text_config"], "model_type": "gemma3"}  # the multimodal config's language model
    if arch in ("idefics3", "smolvlm") and isinstance(cfg.get("text_config"), Mapping):  # SmolVLM: a Llama inside
        text = cfg["text_config"]
        cfg = {**text, "tie_word_embeddings": cfg.get("tie_word_embeddings", text.get("tie_word_embeddings"))}
        arch = str(text.get("model_type") or "llama")
    if not isinstance(arch, str):
        raise ModelLoadError("config.json has no model_type or architectures")
    arch = HF_MODEL_TYPES.get(arch, VARIANT_HF_MODEL_TYPES.get(arch, arch))
    check_architecture(arch)
    cfg = variant_text_config(arch, cfg)
    if arch == "gemma4":
        from .gemma4_config import gemma4_config_from_hf

        return gemma4_config_from_hf(cfg)
    if arch in HYBRID_ARCHITECTURES:
        from .qwen35_config import qwen35_config_from_hf

        return qwen35_config_from_hf(arch, cfg)
    try:
        moe = _moe_from_hf(arch, cfg)
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        scaling = None
        # transformers < 5 writes `rope_scaling`; 5.x writes `rope_parameters` (which also holds rope_theta)
        rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or None
        if rs and isinstance(rs.get("full_attention"), Mapping):  # per layer type (Gemma 3): the global layers'
            rs = rs["full_attention"]
        if rs:
            kind = rs.get("rope_type") or rs.get("type")
            if kind == "linear":
                scaling = RopeScaling("linear", factor=float(rs["factor"]))
            elif kind == "llama3":
                scaling = RopeScaling(
                    "llama3",
                    factor=float(rs["factor"]),
                    low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
                    high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
                    original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
                )
            elif kind in ("longrope", "su") and arch == "phi3":
                scaling = RopeScaling(
                    "longrope", factor=float(rs.get("attention_factor") or 1.0),
                    original_max_position_embeddings=int(cfg.get("original_max_position_embeddings")
                                                         or rs.get("original_max_position_embeddings")),
                    short_factors=tuple(float(f) for f in rs["short_factor"]))
            elif kind == "yarn":
                scaling = RopeScaling(
                    "yarn", factor=float(rs["factor"]),
                    original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
                    beta_fast=float(rs.get("beta_fast") or 32.0), beta_slow=float(rs.get("beta_slow") or 1.0),
                    truncate=bool(rs.get("truncate", True)),
                    attention_factor=yarn_attention_factor_from_hf(rs))
            elif kind not in ("default", None):
                raise UnsupportedModelError(f"RoPE scaling type {kind!r} is not supported")
        partial = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0) and arch != "phi3":  # Phi-4-mini: edgeserve.models.phi3
            raise UnsupportedModelError(f"partial rotary embeddings (partial_rotary_factor {partial}) are not supported")
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:  # newer transformers nest it under rope_parameters
            rp = cfg.get("rope_parameters") or {}
            rope_theta = (rp.get("full_attention") or rp).get("rope_theta", 10000.0)
        config = ModelConfig(
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
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            qk_norm=arch in ("qwen3", "gemma3", "qwen3moe"),
            rope_scaling=scaling,
            sliding_window=cfg.get("sliding_window")
            if cfg.get("use_sliding_window", arch in ("mistral", "phi3")) else None,
            rotary_dim=int(int(cfg.get("head_dim") or hidden // heads) * float(partial))
            if partial not in (None, 1, 1.0) else None,
            **_gemma_from_hf(arch, cfg),
            **_gpt_oss_from_hf(arch, cfg),
            **moe,
        )
        fields = variant_fields_from_hf(arch, cfg, config.num_layers)  # issue 33's variants
        return replace(config, **fields) if fields else config
    except KeyError as e:
        raise ModelLoadError(f"config.json is missing {e.args[0]!r}") from None
