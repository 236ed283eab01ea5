"""Random-weight Gemma 4 GGUFs of real shapes (llama.cpp arch `gemma4`), for benchmarks and tests: the keys and
tensors llama.cpp's gemma4 loader reads, random values.

E2B's text stack: sliding-window layers (256-wide heads) with every fifth layer global (512-wide heads, proportional
RoPE over a quarter of each head: `rope_freqs` holds 1 for the rotated pairs, 1e30 for the rest), one K/V head; the
last `kv_shared_layers` layers read an earlier layer's K/V and have no `attn_k` / `attn_v` / `attn_k_norm` of their
own, and their MLP is twice as wide; per-layer embeddings (`per_layer_token_embd` [vocab, layers * 256], projected
from the hidden state by `per_layer_model_proj`, gated into each layer by `inp_gate` / `proj` / `post_norm`); every
layer's output scale; final logit soft-capping. The 12B's text stack (gemma4-12b, HF `gemma4_unified`, which
llama.cpp's converter writes as `gemma4`): no per-layer embeddings, KV sharing or double-wide MLPs; every sixth layer
global with one K/V head and V = K (no `attn_v`), the sliding ones 8 K/V heads over a 1,024-token window. Norm weights
are ones (GGUF stores them as used). See edgeserve.bench.random_gguf for the block formats and mixes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgeserve.bench.random_gguf import K_FALLBACK, MIXES, TextShape, add_stack_keys, copy_tokenizer, write_plan


@dataclass(frozen=True)
class Gemma4Shape(TextShape):
    """The dimensions of a Gemma 4 E-model's text stack."""

    head_dim: int  # sliding-window layers
    global_head_dim: int  # full-attention layers
    ffn: int  # doubled in the KV-shared layers
    per_layer: int  # hidden_size_per_layer_input
    kv_shared_layers: int
    global_every: int = 5  # layer i is global when (i + 1) % global_every == 0
    window: int = 512
    partial_rotary: float = 0.25  # of a global head's pairs
    global_kv_heads: int = 0  # a global layer's K/V heads (0: kv_heads)
    k_eq_v: bool = False  # global layers take V = K (no attn_v)

    def is_global(self, layer: int) -> bool:
        """Whether layer `layer` is full attention (else sliding window)."""
        return (layer + 1) % self.global_every == 0

    def is_shared(self, layer: int) -> bool:
        """Whether layer `layer` reads an earlier layer's K/V."""
        return layer >= self.layers - self.kv_shared_layers

    def layer_head_dim(self, layer: int) -> int:
        return self.global_head_dim if self.is_global(layer) else self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        """Layer `layer`'s K/V heads."""
        return (self.global_kv_heads or self.kv_heads) if self.is_global(layer) else self.kv_heads

    def has_v(self, layer: int) -> bool:
        """Whether layer `layer` has a V projection of its own (not KV-shared, not V = K)."""
        return not self.is_shared(layer) and not (self.k_eq_v and self.is_global(layer))

    def layer_ffn(self, layer: int) -> int:
        return self.ffn * (2 if self.is_shared(layer) else 1)


# google/gemma-4-E2B's text_config; gemma4-12b: google/gemma-4-12B's text stack as published (no config.json could
# be read here): 48 layers of width 3,840, 16 heads, sliding layers 256-wide heads with 8 K/V heads over a 1,024 window,
# every sixth layer global (512-wide heads, one K/V head, V = K), MLP 15,360, tied 262,144-token embeddings; these
# count to 11.9B parameters, the model card's 11.95B less its vision / audio projections
GEMMA4_SHAPES = {"gemma4-e2b": Gemma4Shape(1536, 35, 8, 1, 256, 512, 6144, 256, 20),
                 "gemma4-12b": Gemma4Shape(3840, 48, 16, 8, 256, 512, 15360, 0, 0, global_every=6, window=1024,
                                           global_kv_heads=1, k_eq_v=True)}


def gemma4_tensor_shapes(shape: Gemma4Shape, vocab: int) -> dict[str, tuple[int, ...]]:
    """[rows, columns] of each quantized tensor by GGUF name."""
    h, p = shape.hidden, shape.per_layer
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, h)}
    if p:
        out.update({"per_layer_token_embd.weight": (vocab, shape.layers * p),
                    "per_layer_model_proj.weight": (shape.layers * p, h)})
    for i in range(shape.layers):
        hd, f, kv = shape.layer_head_dim(i), shape.layer_ffn(i), shape.layer_kv_heads(i)
        out[f"blk.{i}.attn_q.weight"] = (shape.heads * hd, h)
        if not shape.is_shared(i):
            out[f"blk.{i}.attn_k.weight"] = (kv * hd, h)
        if shape.has_v(i):
            out[f"blk.{i}.attn_v.weight"] = (kv * hd, h)
        out.update({f"blk.{i}.attn_output.weight": (h, shape.heads * hd), f"blk.{i}.ffn_gate.weight": (f, h),
                    f"blk.{i}.ffn_up.weight": (f, h), f"blk.{i}.ffn_down.weight": (h, f)})
        if p:
            out.update({f"blk.{i}.inp_gate.weight": (p, h), f"blk.{i}.proj.weight": (h, p)})
    return out


def gemma4_f32_tensors(shape: Gemma4Shape) -> dict[str, tuple[int, ...]]:
    """The float32 tensors: norms, the per-layer output scales and the global layers' `rope_freqs`."""
    h = shape.hidden
    out: dict[str, tuple[int, ...]] = {"output_norm.weight": (h,), "rope_freqs.weight": (shape.global_head_dim // 2,)}
    if shape.per_layer:
        out["per_layer_proj_norm.weight"] = (shape.per_layer,)
    norms = ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm") + (("post_norm",) if shape.per_layer
                                                                               else ())
    for i in range(shape.layers):
        hd = shape.layer_head_dim(i)
        for norm in norms:
            out[f"blk.{i}.{norm}.weight"] = (h,)
        out[f"blk.{i}.attn_q_norm.weight"] = (hd,)
        if not shape.is_shared(i):
            out[f"blk.{i}.attn_k_norm.weight"] = (hd,)
        out[f"blk.{i}.layer_output_scale.weight"] = (1,)
    return out


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth, and every third in between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def gemma4_tensor_types(shape: Gemma4Shape, mix: str) -> dict[str, str]:
    """The qtype of each quantized tensor for a mix: for Q4_K_M, Q6_K for both embedding tables (the per-layer one
    as the published E2B files' size implies), attn_v (counted over the layers that have one) and ffn_down where
    llama.cpp's quantizer gives more bits, Q4_K elsewhere; Q8_0 and Q4_0 everywhere."""
    if mix not in MIXES or mix == "MXFP4_MOE":
        raise ValueError(f"mix must be one of Q4_K_M, Q8_0, Q4_0 for Gemma 4, not {mix!r}")
    names = gemma4_tensor_shapes(shape, vocab=256)
    if mix != "Q4_K_M":
        return {n: mix for n in names}
    with_v = [i for i in range(shape.layers) if shape.has_v(i)]
    types = {}
    for name, dims in names.items():
        kind = name.split(".")[-2]
        if kind in ("token_embd", "per_layer_token_embd"):
            qt = "Q6_K"
        elif kind == "attn_v":
            qt = "Q6_K" if _more_bits(with_v.index(int(name.split(".")[1])), len(with_v)) else "Q4_K"
        elif kind == "ffn_down":
            qt = "Q6_K" if _more_bits(int(name.split(".")[1]), shape.layers) else "Q4_K"
        else:
            qt = "Q4_K"
        types[name] = K_FALLBACK.get(qt, qt) if dims[-1] % 256 else qt
    return types


def write_random_gemma4(path: str | Path, shape: Gemma4Shape, mix: str, tokenizer_from: str | Path, seed: int = 0,
                        tile_mb: int | None = None, context: int = 131072) -> Path:
    """Write a gemma4 GGUF of `shape` with random weights in the `mix` quantization, using the tokenizer (and
    vocabulary size) of the GGUF `tokenizer_from` (give it a Gemma tokenizer: Gemma 4's has 262,144 tokens)."""
    import gguf

    src = gguf.GGUFReader(str(tokenizer_from))
    vocab = len(src.fields["tokenizer.ggml.tokens"].contents())
    w = gguf.GGUFWriter(str(path), "gemma4")
    kv_heads = [shape.layer_kv_heads(i) for i in range(shape.layers)]
    add_stack_keys(w, shape.layers, context, shape.hidden, [shape.layer_ffn(i) for i in range(shape.layers)],
                   shape.heads, kv_heads if len(set(kv_heads)) > 1 else shape.kv_heads)
    w.add_key_length(shape.global_head_dim)
    w.add_value_length(shape.global_head_dim)
    w.add_key_length_swa(shape.head_dim)
    w.add_value_length_swa(shape.head_dim)
    w.add_rope_dimension_count(shape.global_head_dim)  # llama.cpp's n_rot: the whole head (rope_freqs stills most)
    w.add_rope_dimension_count_swa(shape.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1000000.0)
    w.add_rope_freq_base_swa(10000.0)
    w.add_sliding_window(shape.window)
    w.add_sliding_window_pattern([not shape.is_global(i) for i in range(shape.layers)])
    w.add_shared_kv_layers(shape.kv_shared_layers)
    w.add_embedding_length_per_layer_input(shape.per_layer)
    w.add_final_logit_softcapping(30.0)
    w.add_vocab_size(vocab)
    copy_tokenizer(w, src)
    types = gemma4_tensor_types(shape, mix)
    plan = [(name, dims, "F32") for name, dims in gemma4_f32_tensors(shape).items()]
    plan += [(name, dims, types[name]) for name, dims in gemma4_tensor_shapes(shape, vocab).items()]
    rotated = int(shape.global_head_dim // 2 * shape.partial_rotary)

    def values(name: str, dims: tuple[int, ...]) -> np.ndarray | None:
        if name == "rope_freqs.weight":  # divisors of the frequencies: 1 rotates, 1e30 leaves the pair still
            return np.array([1.0] * rotated + [1e30] * (dims[0] - rotated), dtype=np.float32)
        return None  # norms and output scales: ones

    write_plan(w, plan, np.random.default_rng(seed), values, tile_mb)
    return Path(path)


@dataclass(frozen=True)
class AssistantShape:
    """A Gemma 4 assistant drafter's dimensions (its heads read the target's K/V: the target's head sizes, window
    and K/V heads)."""

    hidden: int
    layers: int
    heads: int
    ffn: int
    global_every: int  # layer i is global when (i + 1) % global_every == 0


# google/gemma-4-E2B-it-assistant as reported (78M parameters, 4 blocks of width 256 beside the 262,144-token head);
# its heads and MLP width are assumed (4 heads, MLP 2048 make the 78M), the last block global
ASSISTANT_SHAPES = {"gemma4-e2b-assistant": AssistantShape(256, 4, 4, 2048, 4)}


def write_random_gemma4_assistant(path: str | Path, shape: AssistantShape, target: Gemma4Shape, mix: str,
                                  tokenizer_from: str | Path, seed: int = 0) -> Path:
    """Write a gemma4-assistant GGUF (llama.cpp's keys and names) of `shape` for a `target` of that shape, random
    weights in `mix` (Q8_0 or Q4_0 everywhere), with the tokenizer of the GGUF `tokenizer_from`."""
    import gguf

    if mix not in ("Q8_0", "Q4_0"):
        raise ValueError(f"mix must be Q8_0 or Q4_0 for an assistant, not {mix!r}")
    src = gguf.GGUFReader(str(tokenizer_from))
    vocab = len(src.fields["tokenizer.ggml.tokens"].contents())
    arch = "gemma4-assistant"
    is_global = [(i + 1) % shape.global_every == 0 for i in range(shape.layers)]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(shape.layers)
    w.add_context_length(131072)
    w.add_embedding_length(shape.hidden)
    w.add_embedding_length_out(target.hidden)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(target.kv_heads)
    w.add_key_length(target.global_head_dim)
    w.add_value_length(target.global_head_dim)
    w.add_key_length_swa(target.head_dim)
    w.add_value_length_swa(target.head_dim)
    w.add_rope_dimension_count(target.global_head_dim)
    w.add_rope_dimension_count_swa(target.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1000000.0)
    w.add_rope_freq_base_swa(10000.0)
    w.add_sliding_window(target.window)
    w.add_sliding_window_pattern([not g for g in is_global])
    w.add_shared_kv_layers(shape.layers)
    w.add_nextn_predict_layers(shape.layers)
    w.add_vocab_size(vocab)
    copy_tokenizer(w, src)
    h = shape.hidden
    plan = [("output_norm.weight", (h,), "F32"), ("rope_freqs.weight", (target.global_head_dim // 2,), "F32"),
            ("token_embd.weight", (vocab, h), mix), ("nextn.pre_projection.weight", (h, 2 * target.hidden), mix),
            ("nextn.post_projection.weight", (target.hidden, h), mix)]
    for i in range(shape.layers):
        hd = target.global_head_dim if is_global[i] else target.head_dim
        plan += [(f"blk.{i}.{n}.weight", (h,), "F32")
                 for n in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")]
        plan += [(f"blk.{i}.attn_q_norm.weight", (hd,), "F32"), (f"blk.{i}.layer_output_scale.weight", (1,), "F32"),
                 (f"blk.{i}.attn_q.weight", (shape.heads * hd, h), mix),
                 (f"blk.{i}.attn_output.weight", (h, shape.heads * hd), mix),
                 (f"blk.{i}.ffn_gate.weight", (shape.ffn, h), mix), (f"blk.{i}.ffn_up.weight", (shape.ffn, h), mix),
                 (f"blk.{i}.ffn_down.weight", (h, shape.ffn), mix)]
    rotated = int(target.global_head_dim // 2 * target.partial_rotary)

    def values(name: str, dims: tuple[int, ...]) -> np.ndarray | None:
        if name == "rope_freqs.weight":
            return np.array([1.0] * rotated + [1e30] * (dims[0] - rotated), dtype=np.float32)
        return None

    write_plan(w, plan, np.random.default_rng(seed), values)
    return Path(path)
