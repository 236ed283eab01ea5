"""Random-weight GGUFs of the Mamba-2 hybrids' shapes (llama.cpp archs `nemotron_h`, `nemotron_h_moe` and
`granitehybrid`), for
benchmarks and side-by-side checks: the tensors, metadata keys and types llama.cpp's loaders read
(src/models/nemotron-h.cpp, granite-hybrid.cpp), random values.

A shape's `blocks` string names each layer's mixer: `M` Mamba-2 (`ssm_in` [2 inner + 2 G N + H, hidden], `ssm_conv1d`
weight [conv_dim, K] and bias, `ssm_dt.bias`, `ssm_a` (A = -exp(A_log): negative) and `ssm_d` [H, 1], `ssm_norm`
[G, inner / G], `ssm_out`), `*` GQA attention without positions (`attn_q/k/v/output`), `-` Nemotron-H's squared-ReLU
MLP block (`ffn_up`, `ffn_down`), `E` nemotron_h_moe's MoE block (the float32 router `ffn_gate_inp` and correction
bias `exp_probs_b.bias`, squared-ReLU experts `ffn_{up,down}_exps`, the shared expert `ffn_{up,down}_shexp`). llama.cpp tells the kinds apart by the per-layer `attention.head_count_kv` (non-zero
on attention) and, for Nemotron-H, `feed_forward_length` (non-zero on MLP blocks): both are written per layer, so
llama-server loads the file (llama.cpp's converter under transformers 5 writes 0 KV heads on every Granite layer,
which it refuses). Every layer has `attn_norm`; Granite 4 H's layers also hold an FFN after `ffn_norm`: SwiGLU
(`ffn_gate/up/down`), or with experts a float32 router `ffn_gate_inp`, the experts (`ffn_{gate,up,down}_exps`) and the
MLP as the shared expert (`ffn_*_shexp`), as llama.cpp's converter writes them. Norms are ones; see
edgeserve.bench.random_gguf for the block formats and mixes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgeserve.bench.random_gguf import (K_FALLBACK, MIXES, TextShape, add_stack_keys, copy_tokenizer,
                                        ffn_tensor_shapes, more_bits, write_plan)
from edgeserve.kernels.torch.mamba2 import Mamba2Dims


@dataclass(frozen=True)
class Mamba2Shape(TextShape):
    """The dimensions of a Nemotron-H or Granite 4 H text stack (`layers` = len(blocks))."""

    arch: str  # nemotron_h, nemotron_h_moe or granitehybrid
    blocks: str  # per layer: M (Mamba-2), * (attention), - (Nemotron-H's MLP block), E (its MoE block)
    head_dim: int
    ffn: int  # the MLP's width (with experts: the shared expert's)
    ssm_heads: int
    ssm_head_dim: int
    ssm_state: int
    ssm_groups: int
    vocab: int
    conv_kernel: int = 4
    tie_embeddings: bool = False
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0
    eps: float = 1e-5
    scales: tuple[float, float, float, float] = (1.0, 1.0, 1.0, 1.0)  # Granite: embedding, residual, attention, logit
    routed_scale: float = 1.0  # nemotron_h_moe's routed_scaling_factor

    @property
    def dims(self) -> Mamba2Dims:
        """The Mamba-2 layers' shape (inner width, conv channels, ssm_in rows)."""
        return Mamba2Dims(self.ssm_heads, self.ssm_head_dim, self.ssm_state, self.ssm_groups, self.conv_kernel)

    def kind(self, layer: int) -> str:
        return self.blocks[layer]


def _pattern(attention: tuple[int, ...], layers: int) -> str:
    return "".join("*" if i in attention else "M" for i in range(layers))


# Sources: Nemotron 3 Nano 4B: nvidia/NVIDIA-Nemotron-3-Nano-4B-BF16's config.json as public code quotes it (hidden
# 3136, 42 blocks "M-M-M-MM-M-M*-M-M*-M-M-M*-M-M-MM*-MMM-M-M-", 40 heads / 8 KV heads of 128, MLP 12544, Mamba-2 96
# heads x 80, state 128, 8 groups, conv 4, vocabulary 131072, eps 1e-5); untied as Nemotron-H's default.
# Granite 4 H Tiny: the published granite-4.0-h-tiny GGUF's metadata (a gguf-dump in public notes: hidden 1536, 40
# layers, 12 heads, 4 KV heads on layers 5, 15, ..., experts of 512 beside a shared 1024, Mamba-2 48 heads over an
# inner 3072, state 128, 1 group, conv 4, vocabulary 100352); 64 experts (its size label 64x994M), 6 a token and the
# multipliers (12, 0.22, 1/128, logits / 6) as recalled from its config.json. Granite 4 H Micro: granite-4.0-h-micro's
# config.json as recalled (hidden 2048, 40 layers with attention at 5, 15, 25, 35 as Tiny's, 32 heads / 8 KV heads,
# MLP 8192, Mamba-2 64 heads x 64, state 128, 1 group; llama.cpp's size table puts 2048-wide granitehybrid at 3B).
MAMBA2_SHAPES = {
    # Nemotron 3 Nano 30B-A3B: its config.json as public code quotes it (hidden 2688, 52 blocks
    # "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", 32 heads / 2 KV heads of 128, 128 experts of 1856, 6 a
    # token, a shared expert of 3712, routed_scaling_factor 2.5, n_group 1, Mamba-2 64 heads x 64, state 128, 8
    # groups, conv 4, vocabulary 131072, untied)
    "nemotron3-nano-30b-a3b": Mamba2Shape(2688, 52, 32, 2, "nemotron_h_moe",
                                          "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", head_dim=128,
                                          ffn=3712, ssm_heads=64, ssm_head_dim=64, ssm_state=128, ssm_groups=8,
                                          vocab=131072, experts=128, experts_used=6, expert_ffn=1856,
                                          routed_scale=2.5),
    "nemotron3-nano-4b": Mamba2Shape(3136, 42, 40, 8, "nemotron_h", "M-M-M-MM-M-M*-M-M*-M-M-M*-M-M-MM*-MMM-M-M-",
                                     head_dim=128, ffn=12544, ssm_heads=96, ssm_head_dim=80, ssm_state=128,
                                     ssm_groups=8, vocab=131072),
    "granite4-h-tiny": Mamba2Shape(1536, 40, 12, 4, "granitehybrid", _pattern((5, 15, 25, 35), 40), head_dim=128,
                                   ffn=1024, ssm_heads=48, ssm_head_dim=64, ssm_state=128, ssm_groups=1, vocab=100352,
                                   tie_embeddings=True, experts=64, experts_used=6, expert_ffn=512, eps=1e-5,
                                   scales=(12.0, 0.22, 0.0078125, 6.0)),
    "granite4-h-micro": Mamba2Shape(2048, 40, 32, 8, "granitehybrid", _pattern((5, 15, 25, 35), 40), head_dim=64,
                                    ffn=8192, ssm_heads=64, ssm_head_dim=64, ssm_state=128, ssm_groups=1,
                                    vocab=100352, tie_embeddings=True, eps=1e-5, scales=(12.0, 0.22, 0.0078125, 8.0)),
}


def with_layers(shape: Mamba2Shape, layers: int) -> Mamba2Shape:
    """The shape's first `layers` blocks (for --layers): the kinds' rhythm kept."""
    from dataclasses import replace

    return replace(shape, layers=layers, blocks=shape.blocks[:layers])


def mamba2_tensor_shapes(shape: Mamba2Shape) -> dict[str, tuple[int, ...]]:
    """[rows, columns] of each quantized tensor by GGUF name ([experts, rows, columns] for expert tensors)."""
    h, hd = shape.hidden, shape.head_dim
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (shape.vocab, h)}
    if not shape.tie_embeddings:
        out["output.weight"] = (shape.vocab, h)
    for i in range(shape.layers):
        p, kind = f"blk.{i}.", shape.kind(i)
        if kind == "M":
            out.update({p + "ssm_in.weight": (shape.dims.in_proj_dim, h), p + "ssm_out.weight": (h, shape.dims.inner)})
        elif kind == "*":
            out.update({p + "attn_q.weight": (shape.heads * hd, h), p + "attn_k.weight": (shape.kv_heads * hd, h),
                        p + "attn_v.weight": (shape.kv_heads * hd, h), p + "attn_output.weight": (h, shape.heads * hd)})
        elif kind == "E":
            e, f, sh = shape.experts, shape.expert_ffn, shape.ffn
            out.update({p + "ffn_up_exps.weight": (e, f, h), p + "ffn_down_exps.weight": (e, h, f),
                        p + "ffn_up_shexp.weight": (sh, h), p + "ffn_down_shexp.weight": (h, sh)})
        else:
            out.update({p + "ffn_up.weight": (shape.ffn, h), p + "ffn_down.weight": (h, shape.ffn)})
        if shape.arch == "granitehybrid":
            out.update(ffn_tensor_shapes(p, h, shape.ffn, shape.experts, shape.expert_ffn))
    return out


def mamba2_f32_tensors(shape: Mamba2Shape) -> dict[str, tuple[int, ...]]:
    """The float32 tensors by GGUF name: norms, the Mamba-2 layers' conv / dt / A / D / norm, routers."""
    h = shape.hidden
    out: dict[str, tuple[int, ...]] = {"output_norm.weight": (h,)}
    for i in range(shape.layers):
        p = f"blk.{i}."
        out[p + "attn_norm.weight"] = (h,)
        if shape.kind(i) == "M":
            out.update({p + "ssm_conv1d.weight": (shape.dims.conv_dim, shape.conv_kernel),
                        p + "ssm_conv1d.bias": (shape.dims.conv_dim,), p + "ssm_dt.bias": (shape.ssm_heads,),
                        p + "ssm_a": (shape.ssm_heads, 1), p + "ssm_d": (shape.ssm_heads, 1),
                        p + "ssm_norm.weight": (shape.ssm_groups, shape.dims.inner // shape.ssm_groups)})
        if shape.kind(i) == "E":
            out.update({p + "ffn_gate_inp.weight": (shape.experts, h), p + "exp_probs_b.bias": (shape.experts,)})
        if shape.arch == "granitehybrid":
            out[p + "ffn_norm.weight"] = (h,)
            if shape.experts:
                out[p + "ffn_gate_inp.weight"] = (shape.experts, h)
    return out


def mamba2_tensor_types(shape: Mamba2Shape, mix: str) -> dict[str, str]:
    """The qtype of each quantized tensor: for Q4_K_M as llama.cpp's quantizer picks them (Q6_K for the embeddings /
    output, attn_v of the attention layers by their own count and ffn_down (_exps / _shexp too) by layer where it
    gives more bits, Q4_K elsewhere, a K type falling back where a row is no multiple of 256 values); else the mix
    everywhere."""
    if mix not in MIXES or mix == "MXFP4_MOE":
        raise ValueError(f"mix must be one of Q4_K_M, Q8_0, Q4_0, not {mix!r}")
    names = mamba2_tensor_shapes(shape)
    if mix != "Q4_K_M":
        return {n: mix for n in names}
    attention = [i for i in range(shape.layers) if shape.kind(i) == "*"]
    types = {}
    for name, dims in names.items():
        kind = name.split(".")[-2]
        i = int(name.split(".")[1]) if name.startswith("blk.") else -1
        if name in ("token_embd.weight", "output.weight"):
            qt = "Q6_K"
        elif kind == "attn_v":
            qt = "Q6_K" if more_bits(attention.index(i), len(attention)) else "Q4_K"
        elif kind.startswith("ffn_down"):
            qt = "Q6_K" if more_bits(i, shape.layers) else "Q4_K"
        else:
            qt = "Q4_K"
        types[name] = K_FALLBACK.get(qt, qt) if dims[-1] % 256 else qt
    return types


def _add_keys(w, shape: Mamba2Shape, context: int) -> None:
    """The `{arch}.*` keys llama.cpp's nemotron_h / granitehybrid loaders read: per-layer KV heads (non-zero on
    attention layers) and, for Nemotron-H, per-layer MLP widths (non-zero on MLP blocks)."""
    kinds = [shape.kind(i) for i in range(shape.layers)]
    nemotron = shape.arch.startswith("nemotron_h")
    ffn = [shape.ffn if k == "-" else shape.expert_ffn if k == "E" else 0 for k in kinds] if nemotron else (
        shape.expert_ffn if shape.experts else shape.ffn)
    add_stack_keys(w, shape.layers, context, shape.hidden, ffn, shape.heads,
                   [shape.kv_heads if k == "*" else 0 for k in kinds])
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_layer_norm_rms_eps(shape.eps)
    w.add_vocab_size(shape.vocab)
    w.add_ssm_conv_kernel(shape.conv_kernel)
    w.add_ssm_inner_size(shape.dims.inner)
    w.add_ssm_state_size(shape.ssm_state)
    w.add_ssm_time_step_rank(shape.ssm_heads)
    w.add_ssm_group_count(shape.ssm_groups)
    if nemotron:
        w.add_layer_norm_eps(shape.eps)  # required by llama.cpp's nemotron_h loader (its MTP head's norm)
        if shape.experts:  # as llama.cpp's converter writes nemotron_h_moe's
            w.add_expert_count(shape.experts)
            w.add_expert_used_count(shape.experts_used)
            w.add_expert_feed_forward_length(shape.expert_ffn)
            w.add_expert_shared_feed_forward_length(shape.ffn)
            w.add_expert_shared_count(1)
            w.add_expert_weights_norm(True)
            w.add_expert_weights_scale(shape.routed_scale)
            w.add_expert_group_count(1)
        return
    embedding, residual, attention, logit = shape.scales
    w.add_embedding_scale(embedding)
    w.add_residual_scale(residual)
    w.add_attention_scale(attention)
    w.add_logit_scale(logit)
    w.add_rope_scaling_finetuned(False)  # Granite's switch for RoPE: off (NoPE attention)
    if shape.experts:
        w.add_expert_count(shape.experts)
        w.add_expert_used_count(shape.experts_used)
        w.add_expert_shared_feed_forward_length(shape.ffn)


def write_random_mamba2(path: str | Path, shape: Mamba2Shape, mix: str, tokenizer_from: str | Path,
                        seed: int = 0, context: int = 131072, tile_mb: int | None = None) -> Path:
    """Write a nemotron_h or granitehybrid GGUF of `shape` with random weights in the `mix` quantization (norms,
    Mamba-2 parameters and routers float32), using the tokenizer of the GGUF `tokenizer_from`, its vocabulary padded
    to the shape's."""
    import gguf

    if len(shape.blocks) != shape.layers:
        raise ValueError(f"{len(shape.blocks)} block kinds for {shape.layers} layers")
    src = gguf.GGUFReader(str(tokenizer_from))
    vocab = len(src.fields["tokenizer.ggml.tokens"].contents())
    if vocab > shape.vocab:
        raise ValueError(f"the tokenizer's {vocab} tokens do not fit the shape's vocabulary of {shape.vocab}")
    w = gguf.GGUFWriter(str(path), shape.arch)
    _add_keys(w, shape, context)
    copy_tokenizer(w, src, pad=shape.vocab - vocab)
    types = mamba2_tensor_types(shape, mix)
    plan = [(name, dims, "F32") for name, dims in mamba2_f32_tensors(shape).items()]
    plan += [(name, dims, types[name]) for name, dims in mamba2_tensor_shapes(shape).items()]
    rng = np.random.default_rng(seed)

    def values(name: str, dims: tuple[int, ...]) -> np.ndarray | None:
        if name.endswith(".ssm_a"):
            return -rng.uniform(1.0, 16.0, size=dims).astype(np.float32)  # A = -exp(A_log), A_log ~ log U(1, 16)
        if name.endswith("exp_probs_b.bias"):
            return rng.normal(0, 0.02, size=dims).astype(np.float32)
        if name.endswith(("ssm_conv1d.weight", "ffn_gate_inp.weight")):
            return rng.normal(0, 0.05 if "gate_inp" in name else 0.2, size=dims).astype(np.float32)
        if name.endswith(("ssm_conv1d.bias", "ssm_dt.bias")):
            return rng.normal(0, 0.1, size=dims).astype(np.float32)
        return None  # norms and D: ones

    write_plan(w, plan, rng, values, tile_mb)
    return Path(path)
