"""benchmarks/make_gguf.py's LFM2 shape (edgeserve.bench.random_lfm2_gguf): a GGUF with the tensors, shapes and
metadata keys llama.cpp's lfm2 loader reads (src/models/lfm2.cpp: load_arch_tensors), which our loader reads back
as the shape and runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from tiny_gguf import write_tiny_llama

from edgeserve.bench.random_lfm2_gguf import LFM2_SHAPES, write_random_lfm2
from edgeserve.loaders.gguf_file import GGUFFile

# llama.cpp's view (ne: columns first) of LFM2.5-1.2B's conv layer 0 and attention layer 2
CONV = {"attn_norm.weight": [2048], "ffn_norm.weight": [2048], "shortconv.conv.weight": [3, 2048],
        "shortconv.in_proj.weight": [2048, 6144], "shortconv.out_proj.weight": [2048, 2048],
        "ffn_gate.weight": [2048, 8192], "ffn_up.weight": [2048, 8192], "ffn_down.weight": [8192, 2048]}
ATTENTION = {"attn_norm.weight": [2048], "ffn_norm.weight": [2048], "attn_q.weight": [2048, 2048],
             "attn_k.weight": [2048, 512], "attn_v.weight": [2048, 512], "attn_output.weight": [2048, 2048],
             "attn_q_norm.weight": [64], "attn_k_norm.weight": [64], "ffn_gate.weight": [2048, 8192],
             "ffn_up.weight": [2048, 8192], "ffn_down.weight": [8192, 2048]}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tok") / "tok.gguf")


def test_lfm2_5_1_2b_has_llama_cpps_tensors_and_keys(tmp_path, tokenizer):
    real = dataclasses.replace(LFM2_SHAPES["lfm2.5-1.2b"], layers=3, attention=(2,))
    f = GGUFFile(write_random_lfm2(tmp_path / "l.gguf", real, "Q4_K_M", tokenizer))
    assert f.architecture == "lfm2"
    want = {"token_embd.weight": [2048, 65536], "token_embd_norm.weight": [2048]}
    for i in range(3):
        want.update({f"blk.{i}.{k}": v for k, v in (ATTENTION if i == 2 else CONV).items()})
    assert {n: list(reversed(f.tensor_info(n).shape)) for n in f.tensor_names()} == want
    m = f.metadata
    assert (m["lfm2.attention.head_count_kv"], m["lfm2.shortconv.l_cache"], m["lfm2.feed_forward_length"],
            m["lfm2.vocab_size"], len(m["tokenizer.ggml.tokens"])) == ([0, 0, 8], 3, 8192, 65536, 65536)


def test_a_small_lfm2_file_loads_and_runs(tmp_path, tokenizer):
    from converter_parity import load_ours, our_logits

    shape = dataclasses.replace(LFM2_SHAPES["lfm2.5-1.2b"], hidden=256, heads=4, kv_heads=2, ffn=512, layers=4,
                                attention=(1, 3), vocab=512)
    loaded = load_ours(write_random_lfm2(tmp_path / "s.gguf", shape, "Q8_0", tokenizer))
    c = loaded.config
    assert (c.architecture, c.num_layers, c.num_linear_layers, c.num_kv_heads, c.intermediate_size) == (
        "lfm2", 4, 2, 2, 512)
    assert torch.isfinite(our_logits(loaded.model, [1, 5, 9, 3, 7, 2, 8, 4] * 3)).all()


def test_a_small_lfm3_file_loads_and_runs_fused(tmp_path, tokenizer):
    """LFM3-1.7B's layout in small (arch lfm3: conv, sliding and global layers, the gate, the sandwich norms,
    proportional RoPE) reads back as its shape and plans the fused stack with its attention options."""
    from converter_parity import load_ours, our_logits

    from edgeserve.kernels.cpu import native as cpu_native

    real = LFM2_SHAPES["lfm3-1.7b"]
    assert (real.layers - len(real.attention), len(real.sliding), len(real.attention) - len(real.sliding)) == (13, 5, 6)
    shape = dataclasses.replace(real, hidden=256, heads=4, kv_heads=2, ffn=512, layers=9, vocab=512, window=4)
    loaded = load_ours(write_random_lfm2(tmp_path / "s3.gguf", shape, "Q8_0", tokenizer), dtype="auto")
    c, model = loaded.config, loaded.model
    assert (c.architecture, c.num_layers, c.num_linear_layers, c.head_dim, c.sandwich_norms) == (
        "lfm3", 9, 5, 64, True)
    assert [layer.window for layer in model.layers if layer.conv is None] == [None, 4, None, 4]
    assert all(layer.gated for layer in model.layers if layer.conv is None)
    assert torch.equal(model.cos[:, 16:], torch.ones_like(model.cos[:, 16:]))  # the unrotated half of the pairs
    if cpu_native.available():
        plan = model.native_decoder()
        assert plan is not None and [plan.layers[i].attn.head_gate for i in (2, 4)] == [1, 1]
    assert torch.isfinite(our_logits(model, [1, 5, 9, 3, 7, 2, 8, 4] * 3)).all()
def test_a_small_lfm2_moe_file_loads_and_runs_fused(tmp_path, tokenizer):
    """LFM2-8B-A1B's shape, small: llama.cpp's lfm2moe keys and expert tensors, read back as its shape, its expert
    layers on the fused stack (moe_layer.c's sigmoid router)."""
    from converter_parity import load_ours, our_logits

    real = LFM2_SHAPES["lfm2-8b-a1b"]
    shape = dataclasses.replace(real, hidden=256, heads=4, kv_heads=2, ffn=512, layers=4, attention=(2,), vocab=512,
                                experts=8, expert_ffn=256)
    f = GGUFFile(write_random_lfm2(tmp_path / "m.gguf", shape, "Q8_0", tokenizer))
    assert f.architecture == "lfm2moe" and f.tensor_info("blk.3.ffn_up_exps.weight").shape[0] == 8
    assert "blk.1.ffn_up.weight" in f.tensor_names() and "blk.2.exp_probs_b.bias" in f.tensor_names()
    assert (f.metadata["lfm2moe.leading_dense_block_count"], f.metadata["lfm2moe.expert_used_count"]) == (2, 4)
    loaded = load_ours(f.path, dtype="auto")
    c = loaded.config
    assert (c.architecture, c.num_experts, c.experts_per_token, c.moe_intermediate_size) == ("lfm2moe", 8, 4, 256)
    assert [layer.moe is not None for layer in loaded.model.layers] == [False, False, True, True]
    assert loaded.model.native_decoder() is not None
    assert torch.isfinite(our_logits(loaded.model, [1, 5, 9, 3, 7, 2, 8, 4] * 3)).all()
