"""ModelConfig: the shape of a Llama-family decoder, read from GGUF metadata or an HF config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from edgeserve.errors import ModelLoadError, UnsupportedModelError

# GGUF `general.architecture` / HF `model_type` values this decoder implements.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# HF `architectures[0]` class names mapped to our architecture names.
HF_CLASS_TO_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: 'linear' or 'llama3' (HF `rope_scaling`)."""

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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
    sliding_window: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def check_architecture(arch: str) -> str:
    """Return `arch` if supported, else refuse it by name."""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return arch


def config_from_gguf(metadata: Mapping[str, Any], tensor_names: set[str]) -> ModelConfig:
    """Build a ModelConfig from GGUF metadata (`{arch}.*` keys) and the file's tensor names."""
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError("GGUF metadata has no general.architecture")
    check_architecture(arch)

    def key(name: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata is missing {arch}.{name}")
        return value

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
    elif scaling_type not in (None, "none"):
        raise UnsupportedModelError(f"RoPE scaling type {scaling_type!r} is not supported")
    # llama-3 scaling is stored in GGUF as a `rope_freqs.weight` tensor of per-frequency factors.
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
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
    )


def config_from_hf(cfg: Mapping[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face `config.json` dict."""
    arch = cfg.get("model_type")
    if arch is None and cfg.get("architectures"):
        arch = HF_CLASS_TO_ARCH.get(cfg["architectures"][0], cfg["architectures"][0])
    if not isinstance(arch, str):
        raise ModelLoadError("config.json has no model_type or architectures")
    check_architecture(arch)
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        scaling = None
        # transformers < 5 writes `rope_scaling`; 5.x writes `rope_parameters` (which also holds rope_theta)
        rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or None
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
            elif kind not in ("default", None):
                raise UnsupportedModelError(f"RoPE scaling type {kind!r} is not supported")
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:  # newer transformers nest it under rope_parameters
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            rope_scaling=scaling,
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", arch == "mistral") else None,
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json is missing {e.args[0]!r}") from None
