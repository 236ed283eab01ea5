"""Random-weight Llama GGUFs of real shapes and quantization mixes (Gemma 3, Qwen3 MoE and gpt-oss blocks, and the
Llama variants SmolLM3, OLMo 2, Granite, Ministral 3 and Phi-4-mini too), for benchmarks and tests.

The weights are random GGUF blocks with scales chosen so values are a few tenths at most (the model talks
nonsense, but every kernel does its real work); the tokenizer and chat template are copied from another GGUF
(by default the default model's), so servers can tokenize and template as usual.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:
    import gguf

# qtype -> (values per block, bytes per block, byte offsets of float16 fields, their values)
_LAYOUT: dict[str, tuple[int, int, tuple[tuple[int, float], ...]]] = {
    "Q4_0": (32, 18, ((0, 0.02),)),
    "Q4_1": (32, 20, ((0, 0.02), (2, -0.15))),
    "Q5_0": (32, 22, ((0, 0.01),)),
    "Q5_1": (32, 24, ((0, 0.01), (2, -0.15))),
    "Q8_0": (32, 34, ((0, 0.001),)),
    "Q4_K": (256, 144, ((0, 0.0003), (2, 0.0002))),
    "Q5_K": (256, 176, ((0, 0.00015), (2, 0.0002))),
    "Q6_K": (256, 210, ((208, 0.00004),)),
    "MXFP4": (32, 17, ()),  # byte 0: an E8M0 exponent (drawn in random_blocks), 16 bytes of 4-bit codes
}
# MXFP4_MOE: llama.cpp's gpt-oss files (MXFP4 experts, Q8_0 for every other matrix, F32 routers / norms / biases)
MIXES = ("Q4_K_M", "Q8_0", "Q4_0", "MXFP4_MOE")


def random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random stored bytes [rows, bytes per row] of a `qtype` tensor [rows, cols], values within a few tenths."""
    per, size, fields = _LAYOUT[qtype]
    if cols % per:
        raise ValueError(f"{qtype} needs rows of a multiple of {per} values, not {cols}")
    n = rows * cols // per
    blocks = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for offset, value in fields:
        jitter = (1.0 + 0.25 * rng.standard_normal(n)).astype(np.float32)
        blocks[:, offset:offset + 2] = (value * jitter).astype(np.float16).view(np.uint8).reshape(n, 2)
    if qtype == "MXFP4":  # scales 2^-8 .. 2^-5: values up to 6 * 2^-5 ~ 0.19
        blocks[:, 0] = rng.integers(127 - 8, 127 - 4, size=n, dtype=np.uint8)
    return blocks.reshape(rows, cols // per * size)


@dataclass(frozen=True)
class TextShape:
    """The dimensions every architecture's text stack has (each random_*_gguf adds its own)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int


@dataclass
class LlamaShape:
    """The dimensions of a Llama-family (or, with `gemma3`, a Gemma 3) model."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    tie_embeddings: bool = True
    head_dim: int | None = None  # None: hidden / heads
    gemma3: bool = False  # Gemma 3's block: Q/K norms, sandwich norms, GELU, 5 sliding-window layers in 6
    experts: int = 0  # > 0: Qwen3 MoE's block (Q/K norms; every layer's FFN `experts` experts of `expert_ffn`)
    experts_used: int = 0
    expert_ffn: int = 0
    gpt_oss: bool = False  # gpt-oss's block: Q/K/V/O biases, attention sinks, expert biases, window on every other layer
    vocab: int | None = None  # pad the tokenizer's vocabulary to this many tokens (gpt-oss's o200k-sized 201,088)
    # a Llama variant's GGUF architecture (see VARIANTS): its keys and the tensors it adds, drops or fuses
    variant: str = ""
    rope_base: float = 500000.0
    rotary_dim: int | None = None  # phi3: partial rotary (Phi-4-mini: 96 of 128)

    qwen3vl: bool = False  # Qwen3-VL's language model: Qwen3's Q/K norms, M-RoPE sections, 3 DeepStack layers
    smolvlm: bool = False  # SmolVLM's language model: SmolVLM's image tokens, chat template and end of turn added

    @property
    def arch(self) -> str:
        if self.variant:
            return self.variant
        if self.qwen3vl:
            return "qwen3vl"
        return "gemma3" if self.gemma3 else "gpt-oss" if self.gpt_oss else "qwen3moe" if self.experts else "llama"

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads


SHAPES = {
    "135m": LlamaShape(576, 30, 9, 3, 1536),
    "1b": LlamaShape(2048, 16, 32, 8, 8192),  # Llama-3.2-1B
    "3b": LlamaShape(3072, 28, 24, 8, 8192),  # Llama-3.2-3B
    "gemma3-1b": LlamaShape(1152, 26, 4, 1, 6912, head_dim=256, gemma3=True),  # Gemma 3 1B
    "qwen3vl-2b": LlamaShape(2048, 28, 16, 8, 6144, head_dim=128, qwen3vl=True),  # Qwen3-VL-2B's language model
    # SmolVLM-256M-Instruct's language model (text_config): SmolLM2-135M's block, untied, 128 tokens added (give it
    # SmolLM2's tokenizer, the default model's)
    "smolvlm-256m": LlamaShape(576, 30, 9, 3, 1536, tie_embeddings=False, vocab=49280, rope_base=100000.0,
                               smolvlm=True),
    # Qwen3-30B-A3B: 128 experts of 768, 8 per token (17+ GB at Q4_K_M: for benchmarks, never for tests)
    "qwen3-30b-a3b": LlamaShape(2048, 48, 32, 4, 6144, tie_embeddings=False, head_dim=128, experts=128,
                                experts_used=8, expert_ffn=768),
    # gpt-oss-20b: 24 layers, 32 experts of 2,880, 4 per token, 64 heads of 64, 8 KV heads, 201,088 tokens (about
    # 12 GB in the MXFP4_MOE mix, the size of llama.cpp's published file)
    "gpt-oss-20b": LlamaShape(2880, 24, 64, 8, 2880, tie_embeddings=False, head_dim=64, experts=32, experts_used=4,
                              expert_ffn=2880, gpt_oss=True, vocab=201088),
    # issue 33's Llama variants at their published sizes (config.json of each), vocabularies padded to theirs
    "smollm3-3b": LlamaShape(2048, 36, 16, 4, 11008, head_dim=128, vocab=128256, variant="smollm3",
                             rope_base=5000000.0),  # no RoPE on every 4th layer (llama.cpp: fixed step 4)
    "olmo2-1b": LlamaShape(2048, 16, 16, 16, 8192, tie_embeddings=False, vocab=100352, variant="olmo2"),
    "granite3.3-2b": LlamaShape(2048, 40, 32, 8, 8192, vocab=49159, variant="granite", rope_base=10000000.0),
    "ministral3-3b": LlamaShape(3072, 26, 32, 8, 9216, head_dim=128, vocab=131072, variant="mistral3",
                                rope_base=1000000.0),
    "phi4-mini": LlamaShape(3072, 32, 24, 8, 8192, vocab=200064, variant="phi3", rope_base=10000.0, rotary_dim=96),
}
VARIANTS = ("smollm3", "olmo2", "granite", "mistral3", "phi3")

# Qwen2-VL's vision tokens (Qwen's ids): a Qwen2 vocabulary GGUF holds them as [PAD...] placeholders
QWEN_VL_TOKENS = {151652: "<|vision_start|>", 151653: "<|vision_end|>", 151654: "<|vision_pad|>",
                  151655: "<|image_pad|>", 151656: "<|video_pad|>"}

# SmolVLM's added tokens at their ids (its tokenizer's added_tokens): SmolLM2's 49,152 tokens, then these
SMOLVLM_TOKENS = {49152: "<global-img>",
                  **{49153 + 6 * r + c: f"<row_{r + 1}_col_{c + 1}>" for r in range(6) for c in range(6)},
                  49189: "<fake_token_around_image>", 49190: "<image>",
                  **{49191 + i: f"<|reserved_special_token_{i}|>" for i in range(88)},
                  49279: "<end_of_utterance>"}
# SmolVLM's chat template (transformers' SmolVLMProcessor default); turns end in <end_of_utterance>
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'] is string %}"
    "{{': ' + message['content']}}{% else %}{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}"
    "{{': '}}{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")

# where a tensor's rows are not a multiple of 256 values, llama.cpp's quantizer falls back from a K type
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def tensor_shapes(shape: LlamaShape, vocab: int) -> dict[str, tuple[int, ...]]:
    """[rows, columns] of each quantized tensor by GGUF name ([experts, rows, columns] for expert tensors)."""
    hd = shape.head_size
    shapes: dict[str, tuple[int, int]] = {"token_embd.weight": (vocab, shape.hidden)}
    if not shape.tie_embeddings:
        shapes["output.weight"] = (vocab, shape.hidden)
    fused = shape.variant == "phi3"  # one attn_qkv, and ffn_up holding gate and up (llama.cpp's Phi-3 layout)
    for i in range(shape.layers):
        if fused:
            shapes[f"blk.{i}.attn_qkv.weight"] = ((shape.heads + 2 * shape.kv_heads) * hd, shape.hidden)
        else:
            shapes.update({f"blk.{i}.attn_q.weight": (shape.heads * hd, shape.hidden),
                           f"blk.{i}.attn_k.weight": (shape.kv_heads * hd, shape.hidden),
                           f"blk.{i}.attn_v.weight": (shape.kv_heads * hd, shape.hidden)})
        shapes[f"blk.{i}.attn_output.weight"] = (shape.hidden, shape.heads * hd)
        if fused:
            shapes.update({f"blk.{i}.ffn_up.weight": (2 * shape.ffn, shape.hidden),
                           f"blk.{i}.ffn_down.weight": (shape.hidden, shape.ffn)})
        elif shape.experts:
            e, f = shape.experts, shape.expert_ffn
            shapes.update({f"blk.{i}.ffn_gate_exps.weight": (e, f, shape.hidden),
                           f"blk.{i}.ffn_up_exps.weight": (e, f, shape.hidden),
                           f"blk.{i}.ffn_down_exps.weight": (e, shape.hidden, f)})
        else:
            shapes.update({f"blk.{i}.ffn_gate.weight": (shape.ffn, shape.hidden),
                           f"blk.{i}.ffn_up.weight": (shape.ffn, shape.hidden),
                           f"blk.{i}.ffn_down.weight": (shape.hidden, shape.ffn)})
    return shapes


def tensor_types(shape: LlamaShape, mix: str) -> dict[str, str]:
    """The qtype of each 2-D tensor for a quantization mix, as llama.cpp's quantizer chooses them
    (Q4_K_M: Q6_K for token_embd / output and for attn_v and ffn_down (an MoE's ffn_down_exps too) in the first
    and last eighth of the layers and every third layer in between; a fused attn_qkv Q5_K; Q4_K elsewhere; a K type
    falls back to Q5_0 /
    Q5_1 / Q8_0 for a tensor whose rows are not a multiple of 256 values, as in Gemma 3 files)."""
    if mix not in MIXES:
        raise ValueError(f"mix must be one of {', '.join(MIXES)}, not {mix!r}")
    if mix == "MXFP4_MOE":
        if not shape.experts:
            raise ValueError("the MXFP4_MOE mix needs an MoE shape")
        return {name: "MXFP4" if "_exps" in name else "Q8_0" for name in tensor_shapes(shape, vocab=1)}
    names = ["token_embd.weight"] + ([] if shape.tie_embeddings else ["output.weight"])
    types = {n: ("Q6_K" if mix == "Q4_K_M" else mix) for n in names}
    n = shape.layers
    for i in range(n):
        more_bits = i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2
        ffn = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps") if shape.experts else ("ffn_gate", "ffn_up", "ffn_down")
        attn = ("attn_qkv",) if shape.variant == "phi3" else ("attn_q", "attn_k", "attn_v")
        for t in (*attn, "attn_output", *ffn):
            qt = mix
            if mix == "Q4_K_M":
                qt = "Q6_K" if t in ("attn_v", "ffn_down", "ffn_down_exps") and more_bits else \
                    "Q5_K" if t == "attn_qkv" else "Q4_K"
            types[f"blk.{i}.{t}.weight"] = qt
    shapes = tensor_shapes(shape, vocab=1)
    types = {name: qt for name, qt in types.items() if name in shapes}  # a fused layout has no gate / q / k / v
    for name, dims in shapes.items():  # columns do not depend on the vocabulary
        if dims[-1] % 256:
            types[name] = K_FALLBACK.get(types[name], types[name])
    return types


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth, and every third in between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def ffn_tensor_shapes(p: str, hidden: int, ffn: int, experts: int = 0, expert_ffn: int = 0
                      ) -> dict[str, tuple[int, ...]]:
    """[rows, columns] of a layer's SwiGLU FFN tensors under prefix `p` ([experts, rows, columns] for experts): the
    dense `ffn_gate/up/down`, or with `experts` the routed experts beside a shared one of width `ffn` (`*_shexp`)."""
    h = hidden
    if not experts:
        return {p + "ffn_gate.weight": (ffn, h), p + "ffn_up.weight": (ffn, h), p + "ffn_down.weight": (h, ffn)}
    e, f = experts, expert_ffn
    return {p + "ffn_gate_exps.weight": (e, f, h), p + "ffn_up_exps.weight": (e, f, h),
            p + "ffn_down_exps.weight": (e, h, f), p + "ffn_gate_shexp.weight": (ffn, h),
            p + "ffn_up_shexp.weight": (ffn, h), p + "ffn_down_shexp.weight": (h, ffn)}


def add_stack_keys(w, layers: int, context: int, hidden: int, ffn, heads: int, kv_heads) -> None:
    """The keys every random model's text stack writes first: block count, context, width, FFN width (a list: per
    layer), attention heads and K/V heads (a list: per layer)."""
    w.add_block_count(layers)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)


def _add_llama_keys(w, shape: LlamaShape, vocab: int) -> None:
    """The `{arch}.*` keys of a random llama-family GGUF of `shape`, as llama.cpp's loader of its architecture
    reads them."""
    import gguf

    hd = shape.head_size
    add_stack_keys(w, shape.layers, 8192, shape.hidden, shape.ffn, shape.heads, shape.kv_heads)
    if shape.gemma3:
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_rope_freq_base(1000000.0)
        w.add_sliding_window(512)
    elif shape.gpt_oss:  # the keys llama.cpp's gpt-oss loader reads (YaRN as in the published files)
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_rope_freq_base(150000.0)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(4096)
        w.add_sliding_window(128)
        w.add_vocab_size(vocab)
        w.add_expert_count(shape.experts)
        w.add_expert_used_count(shape.experts_used)
        w.add_expert_feed_forward_length(shape.expert_ffn)
    elif shape.qwen3vl:  # the keys llama.cpp's qwen3vl loader reads
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_rope_freq_base(5000000.0)
        w.add_vocab_size(vocab)
        w.add_rope_dimension_sections([24, 20, 20, 0])
        w.add_num_deepstack_layers(3)
    elif shape.experts:
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_rope_freq_base(1000000.0)
        w.add_vocab_size(vocab)
        w.add_expert_count(shape.experts)
        w.add_expert_used_count(shape.experts_used)
        w.add_expert_feed_forward_length(shape.expert_ffn)
    else:
        w.add_layer_norm_rms_eps(1e-6 if shape.variant == "olmo2" else 1e-5)
        w.add_rope_freq_base(shape.rope_base)
        w.add_vocab_size(vocab)
        w.add_rope_dimension_count(shape.rotary_dim or hd)
        if shape.head_dim:
            w.add_key_length(hd)
            w.add_value_length(hd)
        add_variant_keys(w, shape)


def _llama_plan(shape: LlamaShape, mix: str, vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, shape in values, qtype) of every tensor of a random llama-family GGUF of `shape` in the `mix`
    quantization; the F32 tensors are norms of ones and routers."""
    hd = shape.head_size
    types = tensor_types(shape, mix)
    plan: list[tuple[str, tuple[int, ...], str]] = [("output_norm.weight", (shape.hidden,), "F32")]
    for name, dims in tensor_shapes(shape, vocab).items():
        plan.append((name, dims, types[name]))
        if name.endswith("attn_output.weight"):
            i = name.split(".")[1]
            norms = ["attn_norm", "ffn_norm"]
            head_norms = [(f"blk.{i}.attn_q_norm.weight", (hd,), "F32"), (f"blk.{i}.attn_k_norm.weight", (hd,), "F32")]
            if shape.gpt_oss:  # biases, sinks, the router (+ bias), expert biases; the pre-MLP norm's own name
                e, f, h = shape.experts, shape.expert_ffn, shape.hidden
                norms = ["attn_norm", "post_attention_norm"]
                plan += [(f"blk.{i}.attn_q.bias", (shape.heads * hd,), "F32"),
                         (f"blk.{i}.attn_k.bias", (shape.kv_heads * hd,), "F32"),
                         (f"blk.{i}.attn_v.bias", (shape.kv_heads * hd,), "F32"),
                         (f"blk.{i}.attn_output.bias", (h,), "F32"),
                         (f"blk.{i}.attn_sinks.weight", (shape.heads,), "F32"),
                         (f"blk.{i}.ffn_gate_inp.weight", (e, h), "F32"), (f"blk.{i}.ffn_gate_inp.bias", (e,), "F32"),
                         (f"blk.{i}.ffn_gate_exps.bias", (e, f), "F32"), (f"blk.{i}.ffn_up_exps.bias", (e, f), "F32"),
                         (f"blk.{i}.ffn_down_exps.bias", (e, h), "F32")]
            elif shape.experts:  # the router stays float32 (llama.cpp does not quantize it); Qwen3's Q/K norms
                plan += [(f"blk.{i}.ffn_gate_inp.weight", (shape.experts, shape.hidden), "F32"), *head_norms]
            elif shape.qwen3vl:
                plan += head_norms
            if shape.gemma3:  # GGUF stores Gemma's (1 + w) norm weights with the 1 added: ones are w = 0
                norms += ["post_attention_norm", "post_ffw_norm"]
                plan += head_norms
            if shape.variant == "olmo2":  # norms after attention and FFN; Q/K norms over the whole projection
                norms = ["post_attention_norm", "post_ffw_norm"]
                plan += [(f"blk.{i}.attn_q_norm.weight", (shape.heads * hd,), "F32"),
                         (f"blk.{i}.attn_k_norm.weight", (shape.kv_heads * hd,), "F32")]
            plan += [(f"blk.{i}.{norm}.weight", (shape.hidden,), "F32") for norm in norms]
    if shape.variant == "phi3":  # LongRoPE's per-frequency factors (one pair for every layer)
        half = (shape.rotary_dim or hd) // 2
        plan += [("rope_factors_long.weight", (half,), "F32"), ("rope_factors_short.weight", (half,), "F32")]
    return plan


def write_random_llama(path: str | Path, shape: LlamaShape, mix: str, tokenizer_from: str | Path,
                       seed: int = 0, tile_mb: int | None = None) -> Path:
    """Write a llama-architecture (or, for a `gemma3` shape, gemma3; for a `gpt_oss` shape, gpt-oss; for another MoE
    shape, qwen3moe) GGUF of `shape` with random weights in the `mix` quantization (routers float32), using the
    tokenizer (and vocabulary size, padded with unreachable tokens to `shape.vocab`) of the GGUF `tokenizer_from`.
    With `tile_mb` each tensor repeats one random draw of about that many MB (rows of whole blocks) instead of
    drawing every byte: many GB are written at disk speed, and the kernels do the same work on any bytes."""
    import gguf

    src = gguf.GGUFReader(str(tokenizer_from))
    tokens = src.fields["tokenizer.ggml.tokens"].contents()
    vocab = max(len(tokens), shape.vocab or 0)
    pad = vocab - len(tokens)  # unreachable normal tokens (no merge makes them) up to the shape's vocabulary size
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), shape.arch)
    _add_llama_keys(w, shape, vocab)
    if shape.smolvlm:
        copy_tokenizer(w, src, pad, SMOLVLM_TOKENS, {"tokenizer.chat_template": SMOLVLM_TEMPLATE,
                                                      "tokenizer.ggml.eos_token_id": 49279})
    else:
        copy_tokenizer(w, src, pad, QWEN_VL_TOKENS if shape.qwen3vl else None)
    # tensor infos first, then each tensor's data drawn and written one at a time: a model of many GB never sits
    # in memory whole
    plan = _llama_plan(shape, mix, vocab)
    write_plan(w, plan, rng, lambda name, dims: _llama_f32_values(name, dims, rng), tile_mb)
    return Path(path)


def add_variant_keys(w: "gguf.GGUFWriter", shape: LlamaShape) -> None:
    """The keys a Llama variant's llama.cpp loader reads, with its published model's values: Granite 3.3's four
    scales, Ministral 3's YaRN and attention temperature, Phi-4-mini's LongRoPE context."""
    import gguf

    if shape.variant == "granite":
        w.add_embedding_scale(12.0)
        w.add_residual_scale(0.22)
        w.add_attention_scale(0.0078125)
        w.add_logit_scale(8.0)
    elif shape.variant == "mistral3":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(16.0)
        w.add_rope_scaling_orig_ctx_len(16384)
        w.add_rope_scaling_yarn_beta_fast(32.0)
        w.add_rope_scaling_yarn_beta_slow(1.0)
        w.add_rope_scaling_yarn_log_mul(1.0)
        w.add_attn_temperature_scale(0.1)
    elif shape.variant == "phi3":
        w.add_rope_scaling_orig_ctx_len(4096)
        w.add_rope_scaling_attn_factors(1.190238)  # sqrt(1 + ln(32) / ln(4096)): 131,072 / 4,096 = 32


def _llama_f32_values(name: str, dims: tuple[int, ...], rng: np.random.Generator) -> np.ndarray | None:
    """Random routers, biases and attention sinks; LongRoPE factors from 1 up; None (ones) for the norms."""
    if name.startswith("rope_factors_"):
        return np.linspace(1.0, 8.0 if "long" in name else 1.5, dims[0], dtype=np.float32)
    if name.endswith("ffn_gate_inp.weight"):
        return rng.normal(0, 0.05, size=dims).astype(np.float32)
    if name.endswith((".bias", "attn_sinks.weight")):
        return rng.normal(0, 0.02, size=dims).astype(np.float32)
    return None


def copy_tokenizer(w: "gguf.GGUFWriter", src: "gguf.GGUFReader", pad: int = 0,
                   control: dict[int, str] | None = None, overrides: dict[str, object] | None = None) -> None:
    """Copy every `tokenizer.*` key of the GGUF `src` into the writer `w`, the vocabulary padded with `pad`
    unreachable normal tokens (no merge makes them); `control`: tokens renamed (by id, padded ones too) and made
    control tokens; `overrides`: keys whose value (of the source's type) replaces the source's, or added."""
    import gguf

    control = control or {}
    n = len(src.fields["tokenizer.ggml.tokens"].contents()) if "tokenizer.ggml.tokens" in src.fields else 0
    for key, field in src.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            value = (overrides or {}).get(key, field.contents())
            if control and key == "tokenizer.ggml.tokens":
                value = [control.get(i, t) for i, t in enumerate(value)]
            elif control and key == "tokenizer.ggml.token_type":
                value = [int(gguf.TokenType.CONTROL) if i in control else t for i, t in enumerate(value)]
            if pad and key == "tokenizer.ggml.tokens":
                value = list(value) + [control.get(n + j, f"<pad_{j}>") for j in range(pad)]
            elif pad and key == "tokenizer.ggml.token_type":
                value = list(value) + [int(gguf.TokenType.CONTROL if n + j in control else gguf.TokenType.NORMAL)
                                       for j in range(pad)]
            elif pad and key == "tokenizer.ggml.scores":
                value = list(value) + [0.0] * pad
            w.add_key_value(key, value, field.types[0], sub)
    for key, value in (overrides or {}).items():  # a key the source lacks: a string or a uint32
        if key not in src.fields:
            (w.add_string if isinstance(value, str) else w.add_uint32)(key, value)


def write_plan(w: "gguf.GGUFWriter", plan: list[tuple[str, tuple[int, ...], str]], rng: np.random.Generator,
               f32_values: Callable[[str, tuple[int, ...]], np.ndarray | None] = lambda name, dims: None,
               tile_mb: int | None = None) -> None:
    """Write the header, the metadata and then each tensor of `plan` ((GGUF name, shape in values, qtype)) one at
    a time: quantized ones as `random_blocks` (with `tile_mb`, one draw of about that many MB repeated), F32 ones as
    `f32_values(name, dims)` or, where that is None, ones; then close `w`."""
    import gguf

    for name, dims, qt in plan:
        if qt == "F32":
            w.add_tensor_info(name, dims, np.dtype(np.float32), 4 * int(np.prod(dims)))
        else:
            per, size, _ = _LAYOUT[qt]
            byte_shape = (*dims[:-1], dims[-1] // per * size)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                              raw_dtype=gguf.GGMLQuantizationType[qt])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, dims, qt in plan:
        if qt != "F32":
            rows = int(np.prod(dims[:-1]))
            if tile_mb:
                per, size, _ = _LAYOUT[qt]
                drawn = random_blocks(qt, min(rows, max(1, tile_mb * 2**20 // (dims[-1] // per * size))), dims[-1], rng)
                blocks = np.resize(drawn, (rows, drawn.shape[1]))  # the drawn rows repeated
            else:
                blocks = random_blocks(qt, rows, dims[-1], rng)
            w.write_tensor_data(blocks.reshape(*dims[:-1], -1))
            continue
        values = f32_values(name, dims)
        w.write_tensor_data(np.ones(dims, dtype=np.float32) if values is None else values)
    w.close()
