"""A transformers state dict as llama.cpp's converter stores it: tensor names from edgeserve's own HF-to-GGUF table
(edgeserve.loaders.gguf_weights.gguf_name, with each architecture package's GGUF_TOP / GGUF_LAYER), and the layout
changes convert_hf_to_gguf.py makes (Q/K rows permuted for Llama's interleaved RoPE, 1 + w norms, experts split
into 3-D stacks, Gated DeltaNet value heads tiled, -exp(A_log))."""

from __future__ import annotations

import re
from typing import Any

import torch

from edgeserve.loaders.gguf_weights import gguf_name, permuted_qk

# HF names as transformers stores them -> the names edgeserve's table knows them by (edgeserve reads these through
# its weight views: gpt-oss's router, Gemma 4's router and experts)
_HF_ALIASES = {
    "gpt-oss": ((".mlp.router.", ".mlp.gate."),),
    "gemma4": ((".router.proj.weight", ".mlp.gate.weight"), (".experts.", ".mlp.experts.")),
}
# llama.cpp's names where edgeserve's table has another (its weight views read these names straight from the file)
_GGUF_OVERRIDES = {
    "gpt-oss": {"post_attention_layernorm.weight": "post_attention_norm.weight"},
    "gemma2": {"post_attention_layernorm.weight": "post_attention_norm.weight",
               "pre_feedforward_layernorm.weight": "ffn_norm.weight",
               "post_feedforward_layernorm.weight": "post_ffw_norm.weight"},
    "gemma4": {"mlp.experts.gate_up_proj": "ffn_gate_up_exps.weight"},
}
_GGUF_OVERRIDES["gemma3"] = _GGUF_OVERRIDES["gemma2"]
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# the text model's names inside a multimodal checkpoint
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_VISION = ("visual", "vision_tower", "multi_modal_projector", "mtp.")


def llama_cpp_name(hf_name: str, arch: str) -> str:
    """The tensor name llama.cpp's converter gives the HF tensor `hf_name` of an `arch` checkpoint."""
    for theirs, ours in _HF_ALIASES.get(arch, ()):
        hf_name = hf_name.replace(theirs, ours)
    m = _LAYER.fullmatch(hf_name)
    if m and m.group(2) in _GGUF_OVERRIDES.get(arch, {}):
        return f"blk.{m.group(1)}.{_GGUF_OVERRIDES[arch][m.group(2)]}"
    return gguf_name(hf_name, arch)


def text_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The language model's tensors under the text model's names (`model.layers...`, `lm_head`), float32."""
    out = {}
    for name, t in state.items():
        if any(v in name for v in _VISION):
            continue
        for theirs, ours in _TEXT_PREFIXES:
            name = name.replace(theirs, ours)
        out[name] = t.detach().float()
    return out


def llama_cpp_tensors(state: dict[str, torch.Tensor], config: Any, arch: str) -> dict[str, torch.Tensor]:
    """`state` (a transformers state dict, text config `config`) as the converter writes an `arch` GGUF: llama.cpp
    names, layouts and values (float32)."""
    sd = text_state(state)
    if getattr(config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)  # a tied checkpoint stores no lm_head, and the GGUF no output
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        for gname, value in _converted(name, t, config, arch, sd):
            out[gname] = value
    rope = getattr(config, "rope_parameters", None) or {}
    if arch == "gemma4":
        out["rope_freqs.weight"] = gemma4_rope_freqs(config)
    if arch == "lfm3" and rope.get("full_attention", {}).get("rope_type") == "proportional":
        out["rope_freqs.weight"] = proportional_rope_freqs(config.head_dim,
                                                           rope["full_attention"]["partial_rotary_factor"])
    if rope.get("rope_type") == "llama3":
        out["rope_freqs.weight"] = llama3_rope_freqs(config, rope)
    if rope.get("long_factor"):  # Phi-3's longrope
        out["rope_factors_long.weight"] = torch.tensor(rope["long_factor"], dtype=torch.float32)
        out["rope_factors_short.weight"] = torch.tensor(rope["short_factor"], dtype=torch.float32)
    return out


def _converted(name: str, t: torch.Tensor, c: Any, arch: str, sd: dict) -> list[tuple[str, torch.Tensor]]:
    """The (llama.cpp name, tensor) pairs one HF tensor becomes."""
    m = _LAYER.fullmatch(name)
    local = m.group(2) if m else ""
    if local.startswith("mlp.experts.") and arch != "gemma4":
        return _experts(m.group(1), local, t, arch)
    if local.startswith("linear_attn."):
        return _deltanet(m.group(1), local, t, c)
    gname = llama_cpp_name(name, arch)
    if permuted_qk(arch) and local in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
        heads = c.num_attention_heads if "q_proj" in local else c.num_key_value_heads
        t = permute_qk(t, heads)
    if name.endswith("norm.weight") and arch in ("gemma2", "gemma3", "qwen35", "qwen35moe"):
        t = t + 1  # the converter stores these norms' (1 + w)
    if local == "conv.conv.weight" and arch in ("lfm2", "lfm3"):
        t = t.squeeze(1)  # the converter's short-conv weight is [channels, kernel]
    if t.dim() == 0:
        t = t.reshape(1)  # a scalar (Gemma 4's layer_scalar) as a 1-element tensor
    return [(gname, t)]


def permute_qk(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: each head's rotate-half pairs interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _experts(i: str, local: str, t: torch.Tensor, arch: str) -> list[tuple[str, torch.Tensor]]:
    """A layer's fused expert tensors as the converter's 3-D stacks: gpt-oss's [E, hidden, 2F] interleaved gate / up
    (and its biases) de-interleaved and transposed, the Qwen MoEs' [E, 2F, hidden] halved."""
    b = f"blk.{i}."
    if arch == "gpt-oss":
        if local == "mlp.experts.gate_up_proj":
            return [(b + "ffn_gate_exps.weight", t[..., 0::2].transpose(1, 2)),
                    (b + "ffn_up_exps.weight", t[..., 1::2].transpose(1, 2))]
        if local == "mlp.experts.gate_up_proj_bias":
            return [(b + "ffn_gate_exps.bias", t[:, 0::2]), (b + "ffn_up_exps.bias", t[:, 1::2])]
        if local == "mlp.experts.down_proj":
            return [(b + "ffn_down_exps.weight", t.transpose(1, 2))]
        return [(b + "ffn_down_exps.bias", t)]
    if local == "mlp.experts.gate_up_proj":
        gate, up = t.chunk(2, dim=1)
        return [(b + "ffn_gate_exps.weight", gate), (b + "ffn_up_exps.weight", up)]
    return [(b + "ffn_down_exps.weight", t)]


def tiled_order(x: torch.Tensor, dim: int, hk: int, group: int, head: int = 1) -> torch.Tensor:
    """x with its value heads along `dim` (blocks of `head` values) moved from grouped order (HF: key head j serves
    value heads j * group ..) to tiled order (llama.cpp's GGUF: value head r * hk + j reads key head j)."""
    shape = list(x.shape)
    dim = dim % len(shape)
    x = x.reshape(*shape[:dim], hk, group, head, *shape[dim + 1:]).transpose(dim, dim + 1)
    return x.reshape(shape)


def _deltanet(i: str, local: str, t: torch.Tensor, c: Any) -> list[tuple[str, torch.Tensor]]:
    """A Qwen3.5 Gated DeltaNet tensor as the converter stores it: value heads tiled, the conv squeezed, A as
    -exp(A_log)."""
    hk, group = c.linear_num_key_heads, c.linear_num_value_heads // c.linear_num_key_heads
    dv, kd = c.linear_value_head_dim, c.linear_num_key_heads * c.linear_key_head_dim
    tile = {"in_proj_z.weight": (0, dv), "in_proj_b.weight": (0, 1), "in_proj_a.weight": (0, 1),
            "dt_bias": (0, 1), "out_proj.weight": (1, dv)}
    part = local.removeprefix("linear_attn.")
    if part in ("in_proj_qkv.weight", "conv1d.weight"):
        t = t[:, 0].clone() if part == "conv1d.weight" else t.clone()
        t[2 * kd:] = tiled_order(t[2 * kd:], 0, hk, group, dv)
    elif part == "A_log":
        part, t = "ssm_a", tiled_order(-t.exp(), 0, hk, group)
    elif part in tile:
        t = tiled_order(t, tile[part][0], hk, group, tile[part][1])
    return [(gguf_name(f"model.layers.{i}.linear_attn.{part}", "qwen35"), t)]


def gemma4_rope_freqs(c: Any) -> torch.Tensor:
    """Gemma 4's proportional RoPE as the converter writes it: a divisor per frequency pair of the global layers'
    heads, 1 where rotated, 1e30 where not."""
    hd = c.per_layer_config[c.layer_types.index("full_attention")].head_dim
    return proportional_rope_freqs(hd, c.rope_parameters["full_attention"]["partial_rotary_factor"])


def proportional_rope_freqs(head_dim: int, partial: float) -> torch.Tensor:
    """Proportional RoPE as a divisor per frequency pair of a head (1 where rotated, 1e30 where not), as llama.cpp's
    Gemma 4 converter writes it (and our LFM3 GGUF)."""
    rotated = int(head_dim * partial / 2)
    return torch.tensor([1.0] * rotated + [1e30] * (head_dim // 2 - rotated))


def llama3_rope_freqs(c: Any, rope: dict[str, Any]) -> torch.Tensor:
    """Llama 3's RoPE scaling as the converter writes it: a divisor per frequency (1 for the high frequencies,
    `factor` for the low ones, smoothly between)."""
    import math

    dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    factor, low, high = rope["factor"], rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    out = []
    for k in range(0, dim, 2):
        wavelen = 2 * math.pi * rope["rope_theta"] ** (k / dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out)
