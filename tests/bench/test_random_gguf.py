"""benchmarks/make_gguf.py's writer (edgeserve.bench.random_gguf): a Gemma 3 shape becomes a gemma3 GGUF in
llama.cpp's Q4_K_M mix (K types falling back to Q5_0 / Q8_0 where a row is not a multiple of 256 values) that
loads with its sliding-window layers and runs on the fused native stack."""

from __future__ import annotations

import gguf
import pytest
import torch
from tiny_gguf import write_tiny_llama

from edgeserve.bench.random_gguf import LlamaShape, tensor_types, write_random_llama
from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.models.load import load_model
from edgeserve.registry import resolve


def test_a_gemma3_shape_writes_a_gemma3_gguf_in_the_q4_k_m_mix(tmp_path):
    tokenizer = write_tiny_llama(tmp_path / "tok.gguf")
    shape = LlamaShape(hidden=320, layers=7, heads=2, kv_heads=1, ffn=512, head_dim=128, gemma3=True)
    path = write_random_llama(tmp_path / "g.gguf", shape, "Q4_K_M", tokenizer)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    want = tensor_types(shape, "Q4_K_M")
    assert {n: types[n] for n in want} == want  # every 2-D tensor as tensor_types says
    assert types["blk.0.attn_q.weight"] == "Q5_0" and types["blk.0.ffn_up.weight"] == "Q5_0"  # 320 columns
    assert types["blk.2.attn_v.weight"] == "Q8_0" and types["token_embd.weight"] == "Q8_0"  # Q6_K's fallback
    assert types["blk.0.attn_output.weight"] == "Q4_K" and types["blk.1.ffn_down.weight"] == "Q4_K"  # 256, 512
    assert types["blk.2.ffn_down.weight"] == "Q6_K" and types["blk.0.attn_q_norm.weight"] == "F32"
    model = load_model(resolve(str(path)), dtype="bfloat16").model
    c = model.config
    assert c.architecture == "gemma3" and c.head_dim == 128 and c.layer_windows.count(None) == 1
    if cpu_native.available():
        assert model.native_decoder() is not None
    from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention
    from edgeserve.kernels.torch.paged_attention import AttentionMetadata

    pool = KVPool(c, 4, 16, model.dtype)
    meta = AttentionMetadata.build([5], [5], [[0, 1, 2, 3]], list(range(5)))
    logits = model.logits(model.forward(torch.arange(3, 8), torch.arange(5), PagedKVAttention(pool, meta)))
    assert logits.shape == (5, c.vocab_size) and torch.isfinite(logits).all()


def test_an_moe_shape_writes_a_qwen3moe_gguf_with_block_experts(tmp_path):
    """A Qwen3-MoE shape (the qwen3-30b-a3b entry scaled down): 3-D expert tensors in the Q4_K_M mix (ffn_down_exps
    Q6_K where llama.cpp gives ffn_down more bits), a float32 router, loaded as block-format experts."""
    from edgeserve.bench.random_gguf import SHAPES
    from edgeserve.kernels.formats.experts import BlockExperts

    real = SHAPES["qwen3-30b-a3b"]
    assert (real.hidden, real.layers, real.experts, real.experts_used, real.expert_ffn) == (2048, 48, 128, 8, 768)
    tokenizer = write_tiny_llama(tmp_path / "tok.gguf")
    shape = LlamaShape(hidden=256, layers=8, heads=4, kv_heads=2, ffn=512, tie_embeddings=False, head_dim=64,
                       experts=8, experts_used=2, expert_ffn=256)
    path = write_random_llama(tmp_path / "m.gguf", shape, "Q4_K_M", tokenizer)
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    assert tensors["blk.0.ffn_gate_exps.weight"].tensor_type.name == "Q4_K"
    assert tensors["blk.0.ffn_down_exps.weight"].tensor_type.name == "Q6_K"  # the first eighth
    assert tensors["blk.1.ffn_down_exps.weight"].tensor_type.name == "Q4_K"
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"
    assert list(tensors["blk.0.ffn_up_exps.weight"].shape) == [256, 256, 8]  # GGUF order of [8, 256, 256]
    assert "blk.0.ffn_gate.weight" not in tensors
    model = load_model(resolve(str(path)), dtype="bfloat16").model
    c = model.config
    assert (c.architecture, c.num_experts, c.experts_per_token, c.moe_intermediate_size) == ("qwen3moe", 8, 2, 256)
    if cpu_native.available():
        assert isinstance(model.layers[0].moe.down, BlockExperts)
        assert [p.qtype.removesuffix("_X8") for p in model.layers[0].moe.down.parts] == ["Q6_K"]
    from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention
    from edgeserve.kernels.torch.paged_attention import AttentionMetadata

    pool = KVPool(c, 4, 16, model.dtype)
    meta = AttentionMetadata.build([5], [5], [[0, 1, 2, 3]], list(range(5)))
    logits = model.logits(model.forward(torch.arange(3, 8), torch.arange(5), PagedKVAttention(pool, meta)))
    assert logits.shape == (5, c.vocab_size) and torch.isfinite(logits).all()


def test_a_gpt_oss_shape_writes_a_gpt_oss_gguf_with_mxfp4_experts(tmp_path):
    """A gpt-oss shape (the gpt-oss-20b entry scaled down) in the MXFP4_MOE mix: MXFP4 3-D experts with biases,
    Q8_0 matrices, attention sinks, a router with a bias, the vocabulary padded to the shape's size; it loads as
    gpt-oss with block-format experts and runs."""
    from edgeserve.bench.random_gguf import SHAPES
    from edgeserve.kernels.formats.experts import BlockExperts

    real = SHAPES["gpt-oss-20b"]
    assert (real.hidden, real.layers, real.experts, real.experts_used, real.expert_ffn, real.vocab, real.heads,
            real.kv_heads, real.head_size) == (2880, 24, 32, 4, 2880, 201088, 64, 8, 64)
    tokenizer = write_tiny_llama(tmp_path / "tok.gguf")
    shape = LlamaShape(hidden=128, layers=2, heads=4, kv_heads=2, ffn=128, tie_embeddings=False, head_dim=32,
                       experts=4, experts_used=2, expert_ffn=128, gpt_oss=True, vocab=1000)
    path = write_random_llama(tmp_path / "g.gguf", shape, "MXFP4_MOE", tokenizer)
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    assert reader.fields["general.architecture"].contents() == "gpt-oss"
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == 1000
    assert tensors["blk.0.ffn_gate_exps.weight"].tensor_type.name == "MXFP4"
    assert tensors["blk.1.ffn_down_exps.weight"].tensor_type.name == "MXFP4"
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == "Q8_0"
    assert tensors["output.weight"].tensor_type.name == "Q8_0"
    for name in ("attn_sinks.weight", "attn_q.bias", "attn_output.bias", "ffn_gate_inp.bias", "ffn_up_exps.bias",
                 "ffn_down_exps.bias", "post_attention_norm.weight"):
        assert tensors[f"blk.1.{name}"].tensor_type.name == "F32"
    assert list(tensors["blk.0.ffn_gate_exps.bias"].shape) == [128, 4]
    model = load_model(resolve(str(path)), dtype="bfloat16").model
    c = model.config
    assert (c.architecture, c.num_experts, c.experts_per_token, c.vocab_size) == ("gpt-oss", 4, 2, 1000)
    if cpu_native.available():
        assert isinstance(model.layers[0].moe.gate_up, BlockExperts)
        assert [p.qtype.removesuffix("_X8") for p in model.layers[0].moe.gate_up.parts] == ["MXFP4", "MXFP4"]
    from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention
    from edgeserve.kernels.torch.paged_attention import AttentionMetadata

    pool = KVPool(c, 4, 16, model.dtype)
    meta = AttentionMetadata.build([5], [5], [[0, 1, 2, 3]], list(range(5)))
    logits = model.logits(model.forward(torch.arange(3, 8), torch.arange(5), PagedKVAttention(pool, meta)))
    assert logits.shape == (5, c.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.parametrize("name", ["smollm3-3b", "olmo2-1b", "granite3.3-2b", "ministral3-3b", "phi4-mini"])
def test_a_variant_shape_writes_its_architecture(tmp_path, name):
    """Issue 33's Llama variants at small size: each file names its architecture with the keys and tensors that set
    it apart (OLMo 2's post-norms and whole-projection Q/K norms, Phi's fused QKV / gate-up and LongRoPE factors,
    Granite's scales, Ministral 3's YaRN and temperature), and loads as that architecture and runs."""
    import dataclasses

    from edgeserve.bench.random_gguf import SHAPES

    real = SHAPES[name]
    shape = dataclasses.replace(real, hidden=256, layers=4, heads=4, kv_heads=2, ffn=512,
                                head_dim=64 if real.head_dim else None, vocab=None,
                                rotary_dim=48 if real.rotary_dim else None)
    path = write_random_llama(tmp_path / "v.gguf", shape, "Q4_K_M", write_tiny_llama(tmp_path / "tok.gguf"))
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t.tensor_type.name for t in reader.tensors}
    arch = reader.fields["general.architecture"].contents()
    assert arch == real.variant
    if arch == "olmo2":
        assert "blk.0.attn_norm.weight" not in tensors and tensors["blk.0.post_ffw_norm.weight"] == "F32"
        assert [t.shape[0] for t in reader.tensors if t.name == "blk.0.attn_q_norm.weight"] == [256]
    elif arch == "phi3":
        assert tensors["blk.0.attn_qkv.weight"] == "Q5_K" and "blk.0.ffn_gate.weight" not in tensors
        assert "rope_factors_long.weight" in tensors and reader.fields["phi3.rope.dimension_count"].contents() == 48
    elif arch == "granite":
        assert reader.fields["granite.logit_scale"].contents() == 8.0
    elif arch == "mistral3":
        assert reader.fields["mistral3.rope.scaling.original_context_length"].contents() == 16384
        assert abs(reader.fields["mistral3.attention.temperature_scale"].contents() - 0.1) < 1e-6
    model = load_model(resolve(str(path)), dtype="float32").model
    c = model.config
    assert c.architecture == arch
    if arch == "smollm3":
        assert c.rope_layers == (True, True, True, False)
    from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention
    from edgeserve.kernels.torch.paged_attention import AttentionMetadata

    pool = KVPool(c, 4, 16, model.dtype)
    meta = AttentionMetadata.build([5], [5], [[0, 1, 2, 3]], list(range(5)))
    logits = model.logits(model.forward(torch.arange(3, 8), torch.arange(5), PagedKVAttention(pool, meta)))
    assert logits.shape == (5, c.vocab_size) and torch.isfinite(logits).all()


def test_a_gemma4_e2b_shape_writes_shared_kv_layers_and_per_layer_embeddings(tmp_path):
    """Gemma 4 E2B's layout at small size: the KV-shared layers have no K/V projections of their own and a double
    MLP, global layers wider heads and `rope_freqs`; it loads as gemma4 with those layers sharing, and runs."""
    from edgeserve.bench.random_gemma4_gguf import GEMMA4_SHAPES, Gemma4Shape, write_random_gemma4

    real = GEMMA4_SHAPES["gemma4-e2b"]
    assert (real.hidden, real.layers, real.kv_shared_layers, real.global_head_dim) == (1536, 35, 20, 512)
    shape = Gemma4Shape(hidden=256, layers=10, heads=2, kv_heads=1, head_dim=64, global_head_dim=128, ffn=256,
                        per_layer=256, kv_shared_layers=5)
    path = write_random_gemma4(tmp_path / "e.gguf", shape, "Q4_K_M", write_tiny_llama(tmp_path / "tok.gguf"))
    reader = gguf.GGUFReader(str(path))
    dims = {t.name: list(t.shape) for t in reader.tensors}
    assert "blk.4.attn_k.weight" in dims and "blk.5.attn_k.weight" not in dims and "blk.9.attn_v.weight" not in dims
    assert dims["blk.9.attn_q.weight"] == [256, 2 * 128] and dims["blk.3.attn_q.weight"] == [256, 2 * 64]
    assert dims["blk.5.ffn_up.weight"] == [256, 512] and dims["blk.4.ffn_up.weight"] == [256, 256]
    assert dims["per_layer_token_embd.weight"][0] == 10 * 256
    model = load_model(resolve(str(path)), dtype="float32").model
    c = model.config
    assert c.architecture == "gemma4" and [c.kv_source(i) != i for i in range(10)] == [False] * 5 + [True] * 5
    from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention
    from edgeserve.kernels.torch.paged_attention import AttentionMetadata

    pool = KVPool(c, 4, 16, model.dtype)
    meta = AttentionMetadata.build([5], [5], [[0, 1, 2, 3]], list(range(5)))
    logits = model.logits(model.forward(torch.arange(3, 8), torch.arange(5), PagedKVAttention(pool, meta)))
    assert logits.shape == (5, c.vocab_size) and torch.isfinite(logits).all()


def test_a_smolvlm_shape_adds_smolvlm_s_image_tokens_at_their_ids(tmp_path):
    """SmolVLM-256M's language model (scaled down): the source tokenizer's vocabulary padded to 49,280 with
    SmolVLM's added tokens at their real ids as control tokens, its chat template and end of turn; edgeserve's
    tokenizer reads a row tag as one token (the Idefics3 prompt expansion needs that)."""
    from edgeserve.bench.command import load_tokenizer
    from edgeserve.bench.random_gguf import SHAPES

    real = SHAPES["smolvlm-256m"]
    assert (real.hidden, real.layers, real.heads, real.kv_heads, real.ffn, real.vocab) == (576, 30, 9, 3, 1536, 49280)
    tokenizer = write_tiny_llama(tmp_path / "tok.gguf")
    shape = LlamaShape(hidden=64, layers=1, heads=2, kv_heads=1, ffn=64, tie_embeddings=False, vocab=49280,
                       smolvlm=True)
    path = write_random_llama(tmp_path / "s.gguf", shape, "Q8_0", tokenizer)
    fields = gguf.GGUFReader(str(path)).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    assert len(tokens) == 49280 and tokens[49152] == "<global-img>" and tokens[49161] == "<row_2_col_3>"
    assert tokens[49189:49191] == ["<fake_token_around_image>", "<image>"] and tokens[49279] == "<end_of_utterance>"
    assert types[49190] == int(gguf.TokenType.CONTROL) and types[49000] == int(gguf.TokenType.NORMAL)
    assert fields["tokenizer.ggml.eos_token_id"].contents() == 49279
    assert "<end_of_utterance>" in fields["tokenizer.chat_template"].contents()
    tok, _ = load_tokenizer(str(path))
    assert tok.token_to_id("<image>") == 49190
    assert tok.encode("<row_2_col_3>", add_special_tokens=False) == [49161]


def test_a_gemma4_12b_shape_writes_single_kv_head_global_layers_with_v_equal_k(tmp_path):
    """Gemma 4 12B's layout at small size: no per-layer embeddings, every sixth layer global with one K/V head and
    no attn_v (V = K), the sliding layers their own K/V heads (a per-layer head_count_kv); edgeserve loads it as
    gemma4 with V = K on the global layer, and runs."""
    from edgeserve.bench.random_gemma4_gguf import GEMMA4_SHAPES, Gemma4Shape, write_random_gemma4

    real = GEMMA4_SHAPES["gemma4-12b"]
    assert (real.hidden, real.layers, real.heads, real.kv_heads, real.ffn, real.window) == (3840, 48, 16, 8, 15360, 1024)
    assert [real.is_global(i) for i in range(48)].count(True) == 8 and real.layer_kv_heads(47) == 1
    shape = Gemma4Shape(hidden=256, layers=6, heads=2, kv_heads=2, head_dim=64, global_head_dim=128, ffn=256,
                        per_layer=0, kv_shared_layers=0, global_every=6, window=1024, global_kv_heads=1, k_eq_v=True)
    path = write_random_gemma4(tmp_path / "g.gguf", shape, "Q4_K_M", write_tiny_llama(tmp_path / "tok.gguf"))
    reader = gguf.GGUFReader(str(path))
    dims = {t.name: list(t.shape) for t in reader.tensors}
    assert dims["blk.0.attn_v.weight"] == [256, 2 * 64] and "blk.5.attn_v.weight" not in dims
    assert dims["blk.5.attn_k.weight"] == [256, 128] and dims["blk.5.attn_q.weight"] == [256, 2 * 128]
    assert not any(n.startswith("per_layer") or n.endswith("inp_gate.weight") for n in dims)
    assert list(reader.fields["gemma4.attention.head_count_kv"].contents()) == [2] * 5 + [1]
    model = load_model(resolve(str(path)), dtype="float32").model
    c = model.config
    assert c.architecture == "gemma4" and c.per_layer_input_size == 0
    assert [layer.k_eq_v for layer in model.layers] == [False] * 5 + [True]
    from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention
    from edgeserve.kernels.torch.paged_attention import AttentionMetadata

    pool = KVPool(c, 4, 16, model.dtype)
    meta = AttentionMetadata.build([5], [5], [[0, 1, 2, 3]], list(range(5)))
    logits = model.logits(model.forward(torch.arange(3, 8), torch.arange(5), PagedKVAttention(pool, meta)))
    assert logits.shape == (5, c.vocab_size) and torch.isfinite(logits).all()
