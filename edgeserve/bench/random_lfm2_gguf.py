"""Random-weight GGUFs of LFM2's shapes (llama.cpp arch `lfm2`), for benchmarks and side-by-side checks: the
tensors, metadata keys and types llama.cpp's lfm2 loader reads, random values.

Layers listed in `attention` are GQA attention (`attn_q`, `attn_k`, `attn_v`, `attn_output`, `attn_q_norm`,
`attn_k_norm`; `attention.head_count_kv` per layer, 0 on the others); the rest are gated short convolutions
(`shortconv.in_proj` [3 hidden, hidden], `shortconv.conv` [hidden, L_cache] float32, `shortconv.out_proj`). Every
layer has `attn_norm` (LFM2's operator norm), `ffn_norm` and the SwiGLU FFN, or (arch `lfm2moe`, past its leading
dense layers) the float32 router `ffn_gate_inp`, the expert bias `exp_probs_b.bias` and the experts
(`ffn_{gate,up,down}_exps`); `token_embd_norm` is the final norm.
The output head is tied to the embeddings, as in the released models. Norm weights are ones; see
edgeserve.bench.random_gguf for the block formats and mixes.

An LFM3 shape (arch `lfm3`: our extension of these keys, pending llama.cpp, as edgeserve.models.archs.lfm3 reads it)
adds the per-head gate (`attn_gate` [heads, hidden]), the sandwich norms (`post_attention_norm`, `post_ffw_norm`),
the sliding layers' window, pattern and RoPE base, and the global layers' proportional RoPE as `rope_freqs` (1 on the
rotated frequency pairs, 1e30 on the others).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgeserve.bench.random_gguf import K_FALLBACK, MIXES, TextShape, add_stack_keys, copy_tokenizer, write_plan


@dataclass(frozen=True)
class Lfm2Shape(TextShape):
    """The dimensions of an LFM2 model's text stack."""

    ffn: int  # the adjusted MLP width llama.cpp's converter writes (feed_forward_length)
    attention: tuple[int, ...]  # the attention layers' indices
    vocab: int
    conv_kernel: int = 3  # conv_L_cache
    arch: str = "lfm2"  # or lfm2moe (experts past the leading dense layers), lfm3
    sliding: tuple[int, ...] = ()  # LFM3: the attention layers with a sliding window (the others are global)
    window: int = 0  # LFM3: their window
    rotated: float = 1.0  # LFM3: the global layers' rotated share of each head's frequency pairs
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0
    dense_layers: int = 0  # lfm2moe's leading layers with the SwiGLU FFN

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# LFM2-1.2B / LFM2.5-1.2B (config.json: hidden 2048, 16 layers, full_attn_idxs, block_ff_dim 12288 adjusted to 8192).
# LFM2-8B-A1B (config.json as public code quotes it: hidden 2048, 24 layers, attention at 2, 6, 10, 14, 18, 21, 32
# heads / 8 KV heads, 2 leading dense layers of 7168, 32 experts of 1792, 4 a token, vocabulary 65536).
LFM2_SHAPES = {
    "lfm2.5-1.2b": Lfm2Shape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192,
                             attention=(2, 5, 8, 10, 12, 14), vocab=65536),
    # LFM3-1.7B (transformers' Lfm3Config defaults, "LiquidAI/LFM3-1.7B": hidden 2048, 24 layers, 16 heads of 128,
    # 4 KV heads, MLP 7680, conv_L_cache 7; global at i % 4 == 2, sliding (256) at the other multiples of 4;
    # proportional RoPE on half the pairs)
    "lfm3-1.7b": Lfm2Shape(hidden=2048, layers=24, heads=16, kv_heads=4, ffn=7680,
                           attention=tuple(i for i in range(24) if i % 4 == 2 or (i % 4 == 0 and i)), vocab=128000,
                           conv_kernel=7, arch="lfm3", sliding=(4, 8, 12, 16, 20), window=256, rotated=0.5),
    "lfm2-8b-a1b": Lfm2Shape(hidden=2048, layers=24, heads=32, kv_heads=8, ffn=7168,
                             attention=(2, 6, 10, 14, 18, 21), vocab=65536, arch="lfm2moe", experts=32,
                             experts_used=4, expert_ffn=1792, dense_layers=2),
}


def _has_experts(shape: Lfm2Shape, layer: int) -> bool:
    return bool(shape.experts) and layer >= shape.dense_layers


def lfm2_tensor_shapes(shape: Lfm2Shape) -> dict[str, tuple[int, ...]]:
    """The quantized tensors by GGUF name, as numpy shapes (rows, cols)."""
    h, f, kv = shape.hidden, shape.ffn, shape.kv_heads * shape.head_dim
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (shape.vocab, h)}
    for i in range(shape.layers):
        p = f"blk.{i}."
        if _has_experts(shape, i):
            e, m = shape.experts, shape.expert_ffn
            out.update({p + "ffn_gate_exps.weight": (e, m, h), p + "ffn_up_exps.weight": (e, m, h),
                        p + "ffn_down_exps.weight": (e, h, m)})
        else:
            out.update({p + "ffn_gate.weight": (f, h), p + "ffn_up.weight": (f, h), p + "ffn_down.weight": (h, f)})
        if i in shape.attention:
            out.update({p + "attn_q.weight": (h, h), p + "attn_k.weight": (kv, h), p + "attn_v.weight": (kv, h),
                        p + "attn_output.weight": (h, h)})
            if shape.arch == "lfm3":
                out[p + "attn_gate.weight"] = (shape.heads, h)
        else:
            out.update({p + "shortconv.in_proj.weight": (3 * h, h), p + "shortconv.out_proj.weight": (h, h)})
    return out


def lfm2_f32_tensors(shape: Lfm2Shape) -> dict[str, tuple[int, ...]]:
    """The float32 tensors by GGUF name: norms, the convolutions' weights, routers and expert biases."""
    h = shape.hidden
    out: dict[str, tuple[int, ...]] = {"token_embd_norm.weight": (h,)}
    if shape.arch == "lfm3":
        out["rope_freqs.weight"] = (shape.head_dim // 2,)
    for i in range(shape.layers):
        p = f"blk.{i}."
        out.update({p + "attn_norm.weight": (h,), p + "ffn_norm.weight": (h,)})
        if shape.arch == "lfm3":
            out.update({p + "post_attention_norm.weight": (h,), p + "post_ffw_norm.weight": (h,)})
        if _has_experts(shape, i):
            out.update({p + "ffn_gate_inp.weight": (shape.experts, h), p + "exp_probs_b.bias": (shape.experts,)})
        if i in shape.attention:
            out.update({p + "attn_q_norm.weight": (shape.head_dim,), p + "attn_k_norm.weight": (shape.head_dim,)})
        else:
            out[p + "shortconv.conv.weight"] = (h, shape.conv_kernel)
    return out


def lfm2_tensor_types(shape: Lfm2Shape, mix: str) -> dict[str, str]:
    """The qtype of each quantized tensor: Q4_K_M as llama.cpp picks it for most tensors (Q6_K embeddings, Q6_K
    ffn_down on the first and last eighth and every third layer between, Q4_K elsewhere), or the mix everywhere."""
    if mix not in MIXES or mix == "MXFP4_MOE":
        raise ValueError(f"mix must be one of Q4_K_M, Q8_0, Q4_0, not {mix!r}")
    names = lfm2_tensor_shapes(shape)
    if mix != "Q4_K_M":
        return {n: mix for n in names}
    n = shape.layers
    types = {}
    for name, dims in names.items():
        i = int(name.split(".")[1]) if name.startswith("blk.") else -1
        more = i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2
        kind = "Q6_K" if name == "token_embd.weight" or ("ffn_down" in name and more) else "Q4_K"
        types[name] = K_FALLBACK.get(kind, kind) if dims[-1] % 256 else kind
    return types


def write_random_lfm2(path: str | Path, shape: Lfm2Shape, mix: str, tokenizer_from: str | Path,
                      seed: int = 0, context: int = 128000, tile_mb: int | None = None) -> Path:
    """Write an lfm2 / lfm2moe GGUF of `shape` with random weights in the `mix` quantization, using the tokenizer of
    the GGUF `tokenizer_from`, its vocabulary padded to the shape's."""
    import gguf

    src = gguf.GGUFReader(str(tokenizer_from))
    vocab = len(src.fields["tokenizer.ggml.tokens"].contents())
    if vocab > shape.vocab:
        raise ValueError(f"the tokenizer's {vocab} tokens do not fit the shape's vocabulary of {shape.vocab}")
    w = gguf.GGUFWriter(str(path), shape.arch)
    add_stack_keys(w, shape.layers, context, shape.hidden, shape.ffn, shape.heads,
                   [shape.kv_heads if i in shape.attention else 0 for i in range(shape.layers)])
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(shape.vocab)
    w.add_shortconv_l_cache(shape.conv_kernel)
    if shape.arch == "lfm3":
        _add_lfm3_keys(w, shape)
    if shape.experts:
        w.add_expert_count(shape.experts)
        w.add_expert_used_count(shape.experts_used)
        w.add_expert_feed_forward_length(shape.expert_ffn)
        w.add_leading_dense_block_count(shape.dense_layers)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    copy_tokenizer(w, src, pad=shape.vocab - vocab)
    types = lfm2_tensor_types(shape, mix)
    plan = [(name, dims, "F32") for name, dims in lfm2_f32_tensors(shape).items()]
    plan += [(name, dims, types[name]) for name, dims in lfm2_tensor_shapes(shape).items()]
    rng = np.random.default_rng(seed)

    def values(name: str, dims: tuple[int, ...]) -> np.ndarray | None:
        if name.endswith("shortconv.conv.weight"):
            return rng.normal(0, 0.3, size=dims).astype(np.float32)
        if name == "rope_freqs.weight":
            rotated = int(dims[0] * shape.rotated)
            return np.array([1.0] * rotated + [1e30] * (dims[0] - rotated), dtype=np.float32)
        if name.endswith(("ffn_gate_inp.weight", "exp_probs_b.bias")):
            return rng.normal(0, 0.05, size=dims).astype(np.float32)
        return None  # norms: ones

    write_plan(w, plan, rng, values, tile_mb)
    return Path(path)


def _add_lfm3_keys(w, shape: Lfm2Shape) -> None:
    """LFM3's keys beyond LFM2's: the head size, the sliding layers' window, pattern and RoPE base."""
    arch = shape.arch
    w.add_uint32(f"{arch}.attention.key_length", shape.head_dim)
    w.add_uint32(f"{arch}.attention.value_length", shape.head_dim)
    w.add_uint32(f"{arch}.attention.sliding_window", shape.window)
    w.add_array(f"{arch}.attention.sliding_window_pattern", [i in shape.sliding for i in range(shape.layers)])
    w.add_float32(f"{arch}.rope.freq_base_swa", 10000.0)
