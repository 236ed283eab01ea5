"""The one GGUF writer of the tests: a transformers checkpoint (state dict + config) written as llama.cpp's
convert_hf_to_gguf.py writes it (tensors: support.gguf_tensors; metadata keys: here), with a tiny byte-level BPE
vocabulary (support.gguf_vocab) instead of the checkpoint's tokenizer. tests/test_support_gguf_writer.py checks it
against the converter itself, architecture by architecture."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from support.gguf_tensors import llama_cpp_tensors
from support.gguf_vocab import MERGES, SPECIALS, TOKENS

# the architectures whose converter writes `{arch}.vocab_size` and `rope.dimension_count` (LlamaModel's)
_LLAMA_KEYS = ("llama", "mistral3", "smollm3", "granite")
# matrices never quantized (besides 1-D tensors): biases, norms, routers, convolutions
_KEEP_F32 = (".bias", "norm", "ffn_gate_inp", "conv1d")
QType = str | Callable[[str, torch.Tensor], str]


def write_model_gguf(model: Any, path: Path, arch: str | None = None, **kw: Any) -> Path:
    """A transformers model (its state dict and text config) written as a GGUF; see write_gguf."""
    return write_gguf(path, model.state_dict(), model.config, arch, **kw)


def write_gguf(path: Path, state: dict[str, torch.Tensor], config: Any, arch: str | None = None, *,
               qtype: QType = "F32", tokens: list[str] | None = None, drop: tuple[str, ...] = (),
               metadata: dict[str, Any] | None = None, tensors: dict[str, torch.Tensor] | None = None,
               chat_template: str | None = None, pre: str = "gpt2") -> Path:
    """`state` (HF names, text config `config`) as an `arch` GGUF (default: the registry's name for the config's
    model_type) with llama.cpp's tensor names, layouts and metadata keys. `qtype`: a GGML type for the matrices
    (norms, routers and 1-D tensors stay F32), or a function (GGUF name, tensor) -> type; `tokens`: the vocabulary
    (default the tiny byte-level one, padded to the config's vocab_size); `drop`: GGUF tensor names left out;
    `metadata` / `tensors`: more keys (their values as given; a None value removes a key) and tensors."""
    import gguf

    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    arch = arch or gguf_arch(c)
    w = gguf.GGUFWriter(str(path), arch=arch)
    keys = {**model_metadata(c, arch), **_deepstack(config, arch), **(metadata or {})}
    for key, value in keys.items():
        if value is not None:
            add_key(w, key, value)
    _add_vocab(w, tokens, c.vocab_size, pre, chat_template)
    chooser = qtype if callable(qtype) else matrices(qtype)
    for name, t in {**llama_cpp_tensors(state, c, arch), **(tensors or {})}.items():
        if name not in drop:
            add_tensor(w, name, t, chooser(name, t))
    finish(w)
    return path


def _deepstack(config: Any, arch: str) -> dict[str, Any]:
    """Qwen3-VL's count of vision layers whose features join the first text layers (from its vision config)."""
    layers = getattr(getattr(config, "vision_config", None), "deepstack_visual_indexes", None)
    return {f"{arch}.n_deepstack_layers": len(layers)} if layers else {}


def finish(w: Any) -> None:
    """Write a GGUFWriter's header, keys and tensors to its file and close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_arch(c: Any) -> str:
    """Our (llama.cpp's) architecture name for an HF text config."""
    from edgeserve.models.registry import hf_model_type

    return hf_model_type(c.model_type)


def matrices(qtype: str, experts: str | None = None) -> Callable[[str, torch.Tensor], str]:
    """The chooser of write_gguf's `qtype`: matrices as `qtype` (expert stacks as `experts`, default the same) where
    their rows are whole blocks of it, everything else F32."""
    import gguf

    def choose(name: str, t: torch.Tensor) -> str:
        kind = experts if experts is not None and "_exps" in name else qtype
        if t.dim() < 2 or kind == "F32" or any(k in name for k in _KEEP_F32):
            return "F32"
        block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][0]
        return kind if t.shape[-1] % block == 0 else "F32"

    return choose


def add_tensor(w: Any, name: str, t: torch.Tensor, qtype: str) -> None:
    """One tensor written as GGML type `qtype` (F32, F16, or a type gguf-py quantizes)."""
    import gguf

    data = np.ascontiguousarray(t.detach().float().numpy())
    if qtype == "F32":
        w.add_tensor(name, data)
    elif qtype == "F16":
        w.add_tensor(name, data.astype(np.float16))
    else:
        kind = gguf.GGMLQuantizationType[qtype]
        w.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)


def add_key(w: Any, key: str, value: Any) -> None:
    """One metadata key, typed as the converter types it: bool, uint32, float32, string or array."""
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, list(value))


def _add_vocab(w: Any, tokens: list[str] | None, vocab: int, pre: str, template: str | None) -> None:
    """A byte-level BPE vocabulary of `vocab` entries (`tokens`, default the tiny one, cut to a smaller vocabulary
    or padded with unused entries to a larger one)."""
    import gguf

    tokens = list(tokens or TOKENS)[:vocab]
    merges = [m for m in MERGES if m.replace(" ", "") in tokens]
    kinds = [gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens]
    pad = vocab - len(tokens)
    tokens += [f"[PAD{i}]" for i in range(pad)]
    kinds += [gguf.TokenType.UNUSED] * pad
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(kinds)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    if template is not None:
        w.add_chat_template(template)


def model_metadata(c: Any, arch: str) -> dict[str, Any]:
    """The `{arch}.*` keys llama.cpp's converter writes for the HF text config `c`."""
    rope = dict(getattr(c, "rope_parameters", None) or {})
    full = rope.get("full_attention", rope)
    keys: dict[str, Any] = {
        "block_count": c.num_hidden_layers, "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size, "feed_forward_length": getattr(c, "intermediate_size", None),
        "attention.head_count": c.num_attention_heads, "attention.head_count_kv": _get(c, "num_key_value_heads"),
        "rope.freq_base": float(full.get("rope_theta", getattr(c, "rope_theta", 10000.0))),
        "attention.layer_norm_rms_epsilon": float(getattr(c, "rms_norm_eps", None) or c.norm_eps),
    }
    head_dim = _get(c, "head_dim")
    if head_dim:
        keys["attention.key_length"] = keys["attention.value_length"] = head_dim
    if arch in _LLAMA_KEYS:
        keys["vocab_size"] = c.vocab_size
        keys["rope.dimension_count"] = head_dim or c.hidden_size // c.num_attention_heads
    if rope.get("mrope_section"):  # M-RoPE (the Qwen VL and Qwen3.5 text models): four sections
        keys["rope.dimension_sections"] = list(rope["mrope_section"]) + [0] * (4 - len(rope["mrope_section"]))
    keys.update(_experts(c, arch))
    keys.update(_rope_scaling(full))
    keys.update(_family(c, arch, rope))
    return {f"{arch}.{k}": v for k, v in keys.items() if v is not None}


def _get(c: Any, name: str) -> Any:
    """A config field, or None where the config has none or holds it per layer (Gemma 4's head sizes)."""
    try:
        return getattr(c, name, None)
    except (AttributeError, RuntimeError):  # transformers' AmbiguousGlobalPerLayerAttributeError
        return None


def _experts(c: Any, arch: str) -> dict[str, Any]:
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if not experts or (arch == "gemma4" and not c.enable_moe_block):
        return {}
    used = getattr(c, "num_experts_per_tok", None) or getattr(c, "top_k_experts", None)
    ffn = c.intermediate_size if arch == "gpt-oss" else c.moe_intermediate_size
    return {"expert_count": experts, "expert_used_count": used, "expert_feed_forward_length": ffn,
            "expert_shared_feed_forward_length": getattr(c, "shared_expert_intermediate_size", None)}


def _rope_scaling(full: dict[str, Any]) -> dict[str, Any]:
    kind = full.get("rope_type")
    if kind == "linear":
        return {"rope.scaling.type": "linear", "rope.scaling.factor": float(full["factor"])}
    if kind == "yarn":
        factor = full.get("attention_factor")
        return {"rope.scaling.type": "yarn", "rope.scaling.factor": float(full["factor"]),
                "rope.scaling.original_context_length": full["original_max_position_embeddings"],
                "rope.scaling.yarn_beta_fast": float(full.get("beta_fast", 32.0)),
                "rope.scaling.yarn_beta_slow": float(full.get("beta_slow", 1.0)),
                "rope.scaling.attn_factor": None if factor is None else float(factor)}
    return {}


def _family(c: Any, arch: str, rope: dict[str, Any]) -> dict[str, Any]:
    """The keys of one family's converter (sliding windows, soft-capping, multipliers, hybrids)."""
    if arch == "olmo2" and "sliding_attention" in (getattr(c, "layer_types", None) or ()):
        return {"attention.sliding_window": c.sliding_window,
                "attention.sliding_window_pattern": [t == "sliding_attention" for t in c.layer_types]}
    if arch == "mistral3":
        return {"rope.scaling.yarn_log_multiplier": float(rope["mscale_all_dim"]),
                "attention.temperature_scale": float(rope["llama_4_scaling_beta"])}
    if arch == "granite":
        return {"embedding_scale": float(c.embedding_multiplier), "residual_scale": float(c.residual_multiplier),
                "attention.scale": float(c.attention_multiplier), "logit_scale": float(c.logits_scaling)}
    if arch in ("gemma2", "gemma3", "gpt-oss"):
        keys = {"attention.sliding_window": c.sliding_window}
        if arch == "gemma2":  # no RoPE base: llama.cpp's default is Gemma 2's
            keys.update({"rope.freq_base": None, "attn_logit_softcapping": c.attn_logit_softcapping,
                         "final_logit_softcapping": c.final_logit_softcapping})
        if "sliding_attention" in rope:
            keys["rope.freq_base_swa"] = float(rope["sliding_attention"]["rope_theta"])
        return keys
    if arch == "gemma4":
        return gemma4_metadata(c, rope)
    if arch in ("qwen35", "qwen35moe"):
        return qwen35_metadata(c, rope)
    if arch == "phi3":
        return phi3_metadata(c, rope)
    if arch in ("lfm2", "lfm3"):
        return lfm_metadata(c, arch, rope)
    return {}


def _per_layer(values: list[int]) -> int | list[int]:
    return values if len(set(values)) > 1 else values[0]


def gemma4_metadata(c: Any, rope: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4's keys: per-layer widths and KV heads, its two head sizes, the sliding pattern, shared-KV layers."""
    layers = c.num_hidden_layers
    first_shared = layers - c.num_kv_shared_layers
    ffn = [c.intermediate_size * (2 if c.use_double_wide_mlp and i >= first_shared else 1) for i in range(layers)]
    kv = [c.per_layer_config[i].num_key_value_heads for i in range(layers)]
    global_hd = c.per_layer_config[c.layer_types.index("full_attention")].head_dim
    sliding_hd = c.per_layer_config[c.layer_types.index("sliding_attention")].head_dim
    return {"feed_forward_length": _per_layer(ffn), "attention.head_count_kv": _per_layer(kv),
            "attention.key_length": global_hd, "attention.value_length": global_hd,
            "attention.key_length_swa": sliding_hd, "attention.value_length_swa": sliding_hd,
            "rope.dimension_count": global_hd, "rope.dimension_count_swa": sliding_hd,
            "rope.freq_base_swa": float(rope["sliding_attention"]["rope_theta"]),
            "final_logit_softcapping": c.final_logit_softcapping, "attention.sliding_window": c.sliding_window,
            "attention.sliding_window_pattern": [t == "sliding_attention" for t in c.layer_types],
            "attention.shared_kv_layers": c.num_kv_shared_layers,
            "embedding_length_per_layer_input": c.hidden_size_per_layer_input or 0}


def qwen35_metadata(c: Any, rope: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's keys: the Gated DeltaNet sizes, which layers are recurrent, partial and sectioned RoPE."""
    recurrent = [t == "linear_attention" for t in c.layer_types]
    interval = getattr(c, "full_attention_interval", 4)
    return {"ssm.conv_kernel": c.linear_conv_kernel_dim, "ssm.state_size": c.linear_key_head_dim,
            "ssm.group_count": c.linear_num_key_heads, "ssm.time_step_rank": c.linear_num_value_heads,
            "ssm.inner_size": c.linear_num_value_heads * c.linear_value_head_dim,
            "attention.recurrent_layers": recurrent, "full_attention_interval": interval,
            "rope.dimension_count": int(c.head_dim * rope.get("partial_rotary_factor", 1.0))}


def lfm_metadata(c: Any, arch: str, rope: dict[str, Any]) -> dict[str, Any]:
    """LFM2's keys (per-layer KV heads, 0 on the conv layers; the conv cache; the adjusted MLP width) and, for LFM3
    (our extension, pending llama.cpp: edgeserve.models.archs.lfm3), the sliding layers' window, pattern and RoPE base
    in Gemma 4's spelling, the global layers' proportional RoPE over the whole head (`rope_freqs`: gguf_tensors)."""
    from edgeserve.models.archs.lfm2.config import feed_forward_width

    keys: dict[str, Any] = {"attention.head_count_kv": [0 if t == "conv" else c.num_key_value_heads
                                                        for t in c.layer_types],
                            "shortconv.l_cache": c.conv_L_cache, "vocab_size": c.vocab_size}
    if arch == "lfm2":
        keys["feed_forward_length"] = feed_forward_width(c.to_dict())
        return keys
    keys.update({"rope.freq_base_swa": float(rope["sliding_attention"]["rope_theta"]),
                 "rope.dimension_count": c.head_dim, "attention.sliding_window": c.sliding_window,
                 "attention.sliding_window_pattern": [t == "sliding_attention" for t in c.layer_types]})
    return keys


def phi3_metadata(c: Any, rope: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's keys: partial RoPE as its dimension count, no head size, the window (0: none), longrope's original
    context and attention factor (its factors are tensors: support.gguf_tensors)."""
    import math

    heads, hidden = c.num_attention_heads, c.hidden_size
    original = rope.get("original_max_position_embeddings") or getattr(c, "original_max_position_embeddings", None)
    rotated = int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads
    keys = {"attention.key_length": None, "attention.value_length": None,
            "attention.sliding_window": c.sliding_window or 0, "rope.dimension_count": rotated,
            "rope.scaling.original_context_length": original}
    if rope.get("long_factor"):
        scale = c.max_position_embeddings / original
        keys["rope.scaling.attn_factor"] = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    return keys


def write_raw_tensors(path: Path, tensors: dict[str, tuple[np.ndarray, Any]], arch: str = "llama") -> Path:
    """A GGUF of stored tensor bytes only (no model keys): name -> (data as stored, GGML type or its name), for tests
    of the formats themselves."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch=arch)
    for name, (data, qtype) in tensors.items():
        kind = gguf.GGMLQuantizationType[qtype] if isinstance(qtype, str) else qtype
        w.add_tensor(name, data, raw_dtype=kind)
    finish(w)
    return path
