"""benchmarks/make_gguf.py's Qwen3.5 shapes (edgeserve.bench.random_hybrid_gguf): GGUFs with exactly the tensors,
shapes, types and metadata keys llama.cpp's qwen35 / qwen35moe loaders read (src/models/qwen35.cpp,
qwen35moe.cpp), parsed back with our GGUF reader."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
from tiny_gguf import write_tiny_llama

from edgeserve.bench.random_hybrid_gguf import HYBRID_SHAPES, HybridShape, hybrid_tensor_types, write_random_hybrid
from edgeserve.loaders.gguf_file import GGUFFile

# llama.cpp's view, in its order (ne: columns first): what one Gated DeltaNet layer and one full-attention layer of
# Qwen3.5-0.8B hold
DELTANET_0_8B = {"attn_norm.weight": [1024], "post_attention_norm.weight": [1024],
                 "attn_qkv.weight": [1024, 6144], "attn_gate.weight": [1024, 2048], "ssm_conv1d.weight": [4, 6144],
                 "ssm_dt.bias": [16], "ssm_a": [16], "ssm_alpha.weight": [1024, 16], "ssm_beta.weight": [1024, 16],
                 "ssm_norm.weight": [128], "ssm_out.weight": [2048, 1024], "ffn_gate.weight": [1024, 3584],
                 "ffn_up.weight": [1024, 3584], "ffn_down.weight": [3584, 1024]}
ATTENTION_0_8B = {"attn_norm.weight": [1024], "post_attention_norm.weight": [1024], "attn_q.weight": [1024, 4096],
                  "attn_k.weight": [1024, 512], "attn_v.weight": [1024, 512], "attn_output.weight": [2048, 1024],
                  "attn_q_norm.weight": [256], "attn_k_norm.weight": [256], "ffn_gate.weight": [1024, 3584],
                  "ffn_up.weight": [1024, 3584], "ffn_down.weight": [3584, 1024]}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tok") / "tok.gguf")


def _ne(info) -> list[int]:
    """A tensor's shape as llama.cpp writes it (ne: the fastest dimension first)."""
    return list(reversed(info.shape))


def test_qwen35_0_8b_has_llama_cpps_tensors_and_keys(tmp_path, tokenizer):
    real = HYBRID_SHAPES["qwen35-0.8b"]
    assert (real.hidden, real.layers, real.heads, real.kv_heads, real.head_dim, real.ffn) == (1024, 24, 8, 2, 256, 3584)
    path = write_random_hybrid(tmp_path / "q.gguf", dataclasses.replace(real, layers=4), "Q4_K_M", tokenizer)
    f = GGUFFile(path)
    vocab = len(f.metadata["tokenizer.ggml.tokens"])
    assert f.architecture == "qwen35"
    want = {"token_embd.weight": [1024, vocab], "output_norm.weight": [1024]}
    for i in range(4):
        want.update({f"blk.{i}.{k}": v for k, v in (ATTENTION_0_8B if i == 3 else DELTANET_0_8B).items()})
    assert {n: _ne(f.tensor_info(n)) for n in f.tensor_names()} == want  # tied embeddings: no output.weight
    meta = {k: v for k, v in f.metadata.items() if k.startswith("qwen35.")}
    assert meta == {
        "qwen35.block_count": 4, "qwen35.context_length": 262144, "qwen35.embedding_length": 1024,
        "qwen35.feed_forward_length": 3584, "qwen35.attention.head_count": 8, "qwen35.attention.head_count_kv": 2,
        "qwen35.attention.key_length": 256, "qwen35.attention.value_length": 256,
        "qwen35.attention.layer_norm_rms_epsilon": pytest.approx(1e-6), "qwen35.rope.freq_base": 1e7,
        "qwen35.rope.dimension_count": 64, "qwen35.rope.dimension_sections": [11, 11, 10, 0],
        "qwen35.vocab_size": vocab, "qwen35.ssm.conv_kernel": 4, "qwen35.ssm.state_size": 128,
        "qwen35.ssm.group_count": 16, "qwen35.ssm.time_step_rank": 16, "qwen35.ssm.inner_size": 2048,
        "qwen35.full_attention_interval": 4}
    types = {n: f.tensor_info(n).qtype for n in f.tensor_names()}
    assert types["blk.0.attn_qkv.weight"] == "Q5_K" and types["blk.0.ssm_out.weight"] == "Q4_K"
    assert types["blk.3.attn_v.weight"] == "Q6_K" and types["token_embd.weight"] == "Q6_K"
    assert {types[f"blk.0.{n}"] for n in ("ssm_conv1d.weight", "ssm_a", "ssm_dt.bias", "ssm_norm.weight")} == {"F32"}
    assert (f.raw("blk.0.ssm_a") < 0).all()  # A = -exp(A_log)
    assert np.isfinite(f.load_tensor("blk.0.attn_qkv.weight").numpy()).all()


def test_every_layer_of_the_real_shapes():
    """Layers 3, 7, ... are full attention; the rest Gated DeltaNet, with the 2B's wider tensors."""
    from edgeserve.bench.random_hybrid_gguf import hybrid_tensor_shapes

    two = HYBRID_SHAPES["qwen35-2b"]
    assert (two.hidden, two.layers, two.ffn, two.linear_k_heads, two.linear_v_heads) == (2048, 24, 6144, 16, 16)
    names = hybrid_tensor_shapes(two, 1000)
    assert [i for i in range(24) if f"blk.{i}.attn_q.weight" in names] == [3, 7, 11, 15, 19, 23]
    assert sum(n.endswith("attn_qkv.weight") for n in names) == 18
    assert names["blk.0.attn_qkv.weight"] == (6144, 2048) and names["blk.23.attn_q.weight"] == (4096, 2048)
    types = hybrid_tensor_types(two, "Q4_K_M")
    # llama.cpp counts attn_v among the 6 attention layers: more bits for the 3rd and the 6th
    assert [types[f"blk.{i}.attn_v.weight"] for i in (3, 7, 11, 15, 19, 23)] == ["Q4_K", "Q4_K", "Q6_K", "Q4_K",
                                                                                  "Q4_K", "Q6_K"]
    assert set(hybrid_tensor_types(two, "Q8_0").values()) == {"Q8_0"}


def test_qwen35moe_shape_has_routed_and_shared_experts(tmp_path, tokenizer):
    real = HYBRID_SHAPES["qwen35moe-35b-a3b"]
    assert (real.hidden, real.layers, real.experts, real.experts_used, real.expert_ffn, real.linear_v_heads) == (
        2048, 40, 256, 8, 512, 32)
    shape = HybridShape(256, 4, 2, 1, 64, 0, 2, 4, linear_head_dim=32, tie_embeddings=False, experts=4,
                        experts_used=2, expert_ffn=256, shared_ffn=256)
    f = GGUFFile(write_random_hybrid(tmp_path / "m.gguf", shape, "Q4_K_M", tokenizer))
    assert f.architecture == "qwen35moe"
    assert {k: f.metadata[f"qwen35moe.{k}"] for k in ("expert_count", "expert_used_count",
                                                      "expert_feed_forward_length",
                                                      "expert_shared_feed_forward_length")} == {
        "expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 256,
        "expert_shared_feed_forward_length": 256}
    ne = {n: _ne(f.tensor_info(n)) for n in f.tensor_names() if n.startswith("blk.0.ffn")}
    assert ne == {"blk.0.ffn_gate_inp.weight": [256, 4], "blk.0.ffn_gate_inp_shexp.weight": [256],
                  "blk.0.ffn_gate_exps.weight": [256, 256, 4], "blk.0.ffn_up_exps.weight": [256, 256, 4],
                  "blk.0.ffn_down_exps.weight": [256, 256, 4], "blk.0.ffn_gate_shexp.weight": [256, 256],
                  "blk.0.ffn_up_shexp.weight": [256, 256], "blk.0.ffn_down_shexp.weight": [256, 256]}
    assert _ne(f.tensor_info("blk.0.attn_qkv.weight")) == [256, 32 * (2 * 2 + 4)]
    assert "output.weight" in f.tensor_names() and f.tensor_info("blk.0.ffn_gate_inp.weight").qtype == "F32"


def test_make_gguf_writes_a_qwen35_shape(tmp_path, tokenizer):
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    try:
        import make_gguf
    finally:
        sys.path.pop(0)
    out = tmp_path / "cli.gguf"
    assert make_gguf.main([str(out), "--shape", "qwen35-0.8b", "--layers", "1", "--mix", "Q8_0",
                           "--tokenizer-from", str(tokenizer)]) == 0
    f = GGUFFile(out)
    assert f.metadata["qwen35.block_count"] == 1 and f.tensor_info("blk.0.attn_qkv.weight").qtype == "Q8_0"


@pytest.mark.parametrize("name", ["qwen35-0.8b", "qwen35moe-35b-a3b"])
def test_an_mtp_block_follows_the_trunk_as_the_converter_writes_it(tmp_path, tokenizer, name):
    """`mtp_layers`: blk.{layers} is a full-attention layer with its FFN and the nextn tensors, counted in
    block_count and nextn_predict_layers; the loader reads a 2-layer trunk and the MTP head."""
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    small = dict(layers=2, full_attention_interval=2)
    if HYBRID_SHAPES[name].experts:
        small.update(experts=8, experts_used=2)
    shape = dataclasses.replace(HYBRID_SHAPES[name], mtp_layers=1, **small)
    path = write_random_hybrid(tmp_path / "m.gguf", shape, "Q8_0", tokenizer)
    f = GGUFFile(path)
    arch = shape.arch
    assert (f.metadata[f"{arch}.block_count"], f.metadata[f"{arch}.nextn_predict_layers"]) == (3, 1)
    blk2 = {n[len("blk.2."):] for n in f.tensor_names() if n.startswith("blk.2.")}
    assert {"nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight", "nextn.shared_head_norm.weight",
            "attn_q.weight", "attn_output.weight", "attn_q_norm.weight", "post_attention_norm.weight"} <= blk2
    assert _ne(f.tensor_info("blk.2.nextn.eh_proj.weight")) == [2 * shape.hidden, shape.hidden]
    lm = load_model(resolve(str(path)))
    assert (lm.config.num_layers, lm.config.mtp_layers) == (2, 1) and lm.model.mtp is not None
