"""Random-weight GGUFs of Qwen3.5's hybrid shapes (llama.cpp archs `qwen35` and `qwen35moe`), for benchmarks and
tests: the tensors, metadata keys and types llama.cpp's qwen35 / qwen35moe loaders read, random values.

Layer i is full (gated) attention when (i + 1) % full_attention_interval == 0, Gated DeltaNet otherwise. Every
layer has `attn_norm` and `post_attention_norm` (the FFN's input norm) and the FFN (dense `ffn_gate/up/down`, or
a router, routed experts and one shared expert with its sigmoid gate). Full-attention layers: `attn_q` of twice the
heads (per head, the query then its output gate), `attn_k`, `attn_v`, `attn_output`, `attn_q_norm`, `attn_k_norm`.
Gated DeltaNet layers: `attn_qkv` (Q, K, V), `attn_gate` (the output gate z), `ssm_conv1d`, `ssm_dt.bias`, `ssm_a`
(A = -exp(A_log): negative), `ssm_alpha`, `ssm_beta`, `ssm_norm`, `ssm_out`. Norm weights are ones (GGUF stores
Qwen3.5's (1 + w) norms with the 1 added). With `mtp_layers`, the MTP blocks follow the trunk as llama.cpp's
converter writes them: a full-attention layer with its FFN plus `nextn.eh_proj` and the `nextn.{enorm, hnorm,
shared_head_norm}` norms, counted in `block_count` and `nextn_predict_layers`. See edgeserve.bench.random_gguf for the
block formats and mixes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgeserve.bench.random_gguf import (K_FALLBACK, MIXES, TextShape, add_stack_keys, copy_tokenizer,
                                        ffn_tensor_shapes, more_bits, write_plan)


@dataclass(frozen=True)
class HybridShape(TextShape):
    """The dimensions of a Qwen3.5 dense (or, with `experts`, MoE) model's text stack."""

    head_dim: int
    ffn: int  # the dense FFN (for MoE: unused, 0)
    linear_k_heads: int  # Gated DeltaNet Q/K heads (ssm.group_count)
    linear_v_heads: int  # Gated DeltaNet V heads (ssm.time_step_rank)
    linear_head_dim: int = 128  # Q/K and V head size (ssm.state_size)
    conv_kernel: int = 4
    full_attention_interval: int = 4
    rope_dims: int = 64  # partial RoPE: the rotated dims of each head
    rope_sections: tuple[int, int, int, int] = (11, 11, 10, 0)  # M-RoPE sections (pairs of dims)
    tie_embeddings: bool = True
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    mtp_layers: int = 0  # MTP blocks after the trunk (`blk.{layers + j}`, nextn.* tensors, nextn_predict_layers)

    @property
    def arch(self) -> str:
        return "qwen35moe" if self.experts else "qwen35"

    def is_full_attention(self, layer: int) -> bool:
        """Whether layer `layer` is full attention (else Gated DeltaNet); an MTP block is."""
        return layer >= self.layers or (layer + 1) % self.full_attention_interval == 0

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: Q, K and V of the DeltaNet."""
        return self.linear_head_dim * (2 * self.linear_k_heads + self.linear_v_heads)

    @property
    def value_dim(self) -> int:
        return self.linear_head_dim * self.linear_v_heads


# From the models' published config.json (text_config) / model cards.
HYBRID_SHAPES = {
    "qwen35-0.8b": HybridShape(1024, 24, 8, 2, 256, 3584, 16, 16),
    "qwen35-2b": HybridShape(2048, 24, 8, 2, 256, 6144, 16, 16),
    # Qwen3.5-35B-A3B: 256 experts of 512, 8 routed + 1 shared (about 20 GB at Q4_K_M: for benchmarks only)
    "qwen35moe-35b-a3b": HybridShape(2048, 40, 16, 2, 256, 0, 16, 32, tie_embeddings=False, experts=256,
                                     experts_used=8, expert_ffn=512, shared_ffn=512),
}


def hybrid_tensor_shapes(shape: HybridShape, vocab: int) -> dict[str, tuple[int, ...]]:
    """[rows, columns] of each quantized tensor by GGUF name ([experts, rows, columns] for expert tensors)."""
    h, hd = shape.hidden, shape.head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, h)}
    if not shape.tie_embeddings:
        shapes["output.weight"] = (vocab, h)
    for i in range(shape.layers + shape.mtp_layers):
        p = f"blk.{i}."
        if i >= shape.layers:
            shapes[p + "nextn.eh_proj.weight"] = (h, 2 * h)
        if shape.is_full_attention(i):
            shapes.update({p + "attn_q.weight": (2 * shape.heads * hd, h),
                           p + "attn_k.weight": (shape.kv_heads * hd, h), p + "attn_v.weight": (shape.kv_heads * hd, h),
                           p + "attn_output.weight": (h, shape.heads * hd)})
        else:
            shapes.update({p + "attn_qkv.weight": (shape.conv_dim, h), p + "attn_gate.weight": (shape.value_dim, h),
                           p + "ssm_alpha.weight": (shape.linear_v_heads, h),
                           p + "ssm_beta.weight": (shape.linear_v_heads, h),
                           p + "ssm_out.weight": (h, shape.value_dim)})
        shapes.update(ffn_tensor_shapes(p, h, shape.shared_ffn if shape.experts else shape.ffn, shape.experts,
                                         shape.expert_ffn))
    return shapes


def hybrid_f32_tensors(shape: HybridShape) -> dict[str, tuple[int, ...]]:
    """The float32 tensors by GGUF name: norms, the DeltaNet's conv / dt / A, routers (llama.cpp quantizes none)."""
    h = shape.hidden
    out: dict[str, tuple[int, ...]] = {"output_norm.weight": (h,)}
    for i in range(shape.layers + shape.mtp_layers):
        p = f"blk.{i}."
        out.update({p + "attn_norm.weight": (h,), p + "post_attention_norm.weight": (h,)})
        if i >= shape.layers:
            out.update({p + f"nextn.{n}.weight": (h,) for n in ("enorm", "hnorm", "shared_head_norm")})
        if shape.is_full_attention(i):
            out.update({p + "attn_q_norm.weight": (shape.head_dim,), p + "attn_k_norm.weight": (shape.head_dim,)})
        else:
            out.update({p + "ssm_conv1d.weight": (shape.conv_dim, shape.conv_kernel),
                        p + "ssm_dt.bias": (shape.linear_v_heads,), p + "ssm_a": (shape.linear_v_heads,),
                        p + "ssm_norm.weight": (shape.linear_head_dim,)})
        if shape.experts:
            out.update({p + "ffn_gate_inp.weight": (shape.experts, h), p + "ffn_gate_inp_shexp.weight": (h,)})
    return out


def hybrid_tensor_types(shape: HybridShape, mix: str) -> dict[str, str]:
    """The qtype of each quantized tensor for a mix, as llama.cpp's quantizer picks them for Q4_K_M (Q6_K for the
    embeddings / output, attn_v of the attention layers by their own count and ffn_down (also _exps / _shexp) by
    layer where it gives more bits; Q5_K for attn_qkv; Q4_K elsewhere; a K type falls back to Q5_0 / Q5_1 / Q8_0
    where a row is no multiple of 256 values); Q8_0 and Q4_0 everywhere."""
    if mix not in MIXES:
        raise ValueError(f"mix must be one of {', '.join(MIXES)}, not {mix!r}")
    names = hybrid_tensor_shapes(shape, vocab=256)
    if mix != "Q4_K_M":
        return {n: mix for n in names}
    attention = [i for i in range(shape.layers + shape.mtp_layers) if shape.is_full_attention(i)]
    types = {}
    for name in names:
        kind = name.split(".")[-2]
        i = int(name.split(".")[1]) if name.startswith("blk.") else -1
        if name in ("token_embd.weight", "output.weight"):
            types[name] = "Q6_K"
        elif kind == "eh_proj":
            types[name] = "Q8_0"
        elif kind == "attn_qkv":
            types[name] = "Q5_K"
        elif kind == "attn_v":
            types[name] = "Q6_K" if more_bits(attention.index(i), len(attention)) else "Q4_K"
        elif kind.startswith("ffn_down"):
            types[name] = "Q6_K" if more_bits(i, shape.layers) else "Q4_K"
        else:
            types[name] = "Q4_K"
        if names[name][-1] % 256:  # rows that are no multiple of a K block
            types[name] = K_FALLBACK.get(types[name], types[name])
    return types


def write_random_hybrid(path: str | Path, shape: HybridShape, mix: str, tokenizer_from: str | Path,
                        seed: int = 0, context: int = 262144) -> Path:
    """Write a qwen35 (or, for an MoE shape, qwen35moe) GGUF of `shape` with random weights in the `mix`
    quantization, using the tokenizer (and vocabulary size) of the GGUF `tokenizer_from`."""
    import gguf

    src = gguf.GGUFReader(str(tokenizer_from))
    vocab = len(src.fields["tokenizer.ggml.tokens"].contents())
    w = gguf.GGUFWriter(str(path), shape.arch)
    add_stack_keys(w, shape.layers + shape.mtp_layers, context, shape.hidden,
                   shape.shared_ffn if shape.experts else shape.ffn, shape.heads, shape.kv_heads)
    if shape.mtp_layers:
        w.add_nextn_predict_layers(shape.mtp_layers)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000000.0)
    w.add_rope_dimension_count(shape.rope_dims)
    w.add_rope_dimension_sections(list(shape.rope_sections))
    w.add_vocab_size(vocab)
    w.add_ssm_conv_kernel(shape.conv_kernel)
    w.add_ssm_state_size(shape.linear_head_dim)
    w.add_ssm_group_count(shape.linear_k_heads)
    w.add_ssm_time_step_rank(shape.linear_v_heads)
    w.add_ssm_inner_size(shape.value_dim)
    w.add_full_attention_interval(shape.full_attention_interval)
    if shape.experts:
        w.add_expert_count(shape.experts)
        w.add_expert_used_count(shape.experts_used)
        w.add_expert_feed_forward_length(shape.expert_ffn)
        w.add_expert_shared_feed_forward_length(shape.shared_ffn)
    copy_tokenizer(w, src)
    types = hybrid_tensor_types(shape, mix)
    plan = [(name, dims, "F32") for name, dims in hybrid_f32_tensors(shape).items()]
    plan += [(name, dims, types[name]) for name, dims in hybrid_tensor_shapes(shape, vocab).items()]
    rng = np.random.default_rng(seed)

    def values(name: str, dims: tuple[int, ...]) -> np.ndarray | None:
        if name.endswith(".ssm_a"):
            return -rng.uniform(1.0, 16.0, size=dims).astype(np.float32)  # A = -exp(A_log), A_log ~ log U(1, 16)
        if name.endswith(("ssm_conv1d.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")):
            return rng.normal(0, 0.05 if "gate_inp" in name else 0.2, size=dims).astype(np.float32)
        return None  # norms and dt_bias: ones

    write_plan(w, plan, rng, values)
    return Path(path)
