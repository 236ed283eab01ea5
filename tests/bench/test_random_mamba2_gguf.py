"""benchmarks/make_gguf.py's Mamba-2 hybrid shapes (edgeserve.bench.random_mamba2_gguf): GGUFs with the tensors,
shapes and metadata keys llama.cpp's nemotron_h / granitehybrid loaders read (src/models/nemotron-h.cpp,
granite-hybrid.cpp), read back by our loader as the shape, and generating through the engine."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
from tiny_gguf import write_tiny_llama

from edgeserve.bench.random_mamba2_gguf import MAMBA2_SHAPES, mamba2_tensor_types, with_layers, write_random_mamba2
from edgeserve.loaders.gguf_file import GGUFFile

# llama.cpp's view (ne: columns first) of Nemotron 3 Nano 4B's blocks 0 (Mamba-2), 1 (MLP) and 12 (attention)
NANO_MAMBA = {"attn_norm.weight": [3136], "ssm_in.weight": [3136, 17504], "ssm_conv1d.weight": [4, 9728],
              "ssm_conv1d.bias": [9728], "ssm_dt.bias": [96], "ssm_a": [1, 96], "ssm_d": [1, 96],
              "ssm_norm.weight": [960, 8], "ssm_out.weight": [7680, 3136]}
NANO_MLP = {"attn_norm.weight": [3136], "ffn_up.weight": [3136, 12544], "ffn_down.weight": [12544, 3136]}
NANO_ATTENTION = {"attn_norm.weight": [3136], "attn_q.weight": [3136, 5120], "attn_k.weight": [3136, 1024],
                  "attn_v.weight": [3136, 1024], "attn_output.weight": [5120, 3136]}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tok") / "tok.gguf")


def _ne(f: GGUFFile, prefix: str) -> dict[str, list[int]]:
    return {n[len(prefix):]: list(reversed(f.tensor_info(n).shape)) for n in f.tensor_names() if n.startswith(prefix)}


def test_nemotron3_nano_4b_has_llama_cpps_tensors_and_per_layer_keys(tmp_path, tokenizer):
    shape = with_layers(MAMBA2_SHAPES["nemotron3-nano-4b"], 13)  # blocks M-M-M-MM-M-M* : all three kinds
    f = GGUFFile(write_random_mamba2(tmp_path / "n.gguf", shape, "Q4_0", tokenizer))
    assert f.architecture == "nemotron_h"
    assert (_ne(f, "blk.0."), _ne(f, "blk.1."), _ne(f, "blk.12.")) == (NANO_MAMBA, NANO_MLP, NANO_ATTENTION)
    m = f.metadata
    assert m["nemotron_h.attention.head_count_kv"] == [0] * 12 + [8]
    assert m["nemotron_h.feed_forward_length"] == [0, 12544, 0, 12544, 0, 12544, 0, 0, 12544, 0, 12544, 0, 0]
    assert (m["nemotron_h.attention.key_length"], m["nemotron_h.ssm.inner_size"], m["nemotron_h.ssm.group_count"],
            m["nemotron_h.ssm.time_step_rank"], len(m["tokenizer.ggml.tokens"])) == (128, 7680, 8, 96, 131072)
    assert "nemotron_h.attention.layer_norm_epsilon" in m  # llama.cpp's loader requires it
    assert "output.weight" in f.tensor_names()


def test_granite4_h_tiny_writes_kv_heads_on_its_attention_layers_and_experts(tmp_path, tokenizer):
    shape = with_layers(MAMBA2_SHAPES["granite4-h-tiny"], 6)
    f = GGUFFile(write_random_mamba2(tmp_path / "g.gguf", shape, "Q4_K_M", tokenizer))
    m = f.metadata
    assert f.architecture == "granitehybrid"
    # llama.cpp tells a layer's kind by its KV heads: the converter's all-zero list is what llama-server refuses
    assert m["granitehybrid.attention.head_count_kv"] == [0, 0, 0, 0, 0, 4]
    assert (m["granitehybrid.expert_count"], m["granitehybrid.expert_used_count"],
            m["granitehybrid.feed_forward_length"], m["granitehybrid.expert_shared_feed_forward_length"]) == (
        64, 6, 512, 1024)
    assert _ne(f, "blk.5.")["ffn_gate_exps.weight"] == [1536, 512, 64]
    assert _ne(f, "blk.5.")["attn_k.weight"] == [1536, 512]
    assert _ne(f, "blk.0.")["ssm_in.weight"] == [1536, 6448]  # the published file's: 2 x 3072 + 2 x 128 + 48
    assert "output.weight" not in f.tensor_names()


def test_q4_k_m_falls_back_where_rows_are_no_multiple_of_256():
    types = mamba2_tensor_types(MAMBA2_SHAPES["nemotron3-nano-4b"], "Q4_K_M")  # 3136 = 12.25 x 256
    assert types["blk.0.ssm_in.weight"] == "Q5_0" and types["blk.0.ssm_out.weight"] == "Q4_K"
    assert types["token_embd.weight"] == "Q8_0"
    with pytest.raises(ValueError, match="mix must be"):
        mamba2_tensor_types(MAMBA2_SHAPES["granite4-h-micro"], "MXFP4_MOE")


@pytest.mark.parametrize("name", sorted(MAMBA2_SHAPES))
def test_a_small_file_of_each_shape_loads_as_its_shape_and_generates(tmp_path, tokenizer, name):
    from edgeserve.llm import LLM
    from edgeserve.sampling_params import SamplingParams

    real = MAMBA2_SHAPES[name]
    layers = real.blocks.index("*") + 2
    shape = dataclasses.replace(with_layers(real, layers), hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=512,
                                ssm_heads=8, ssm_head_dim=32, ssm_state=16, ssm_groups=min(real.ssm_groups, 2),
                                vocab=512, experts=min(real.experts, 8), expert_ffn=256 if real.experts else 0)
    path = write_random_mamba2(tmp_path / "s.gguf", shape, "Q8_0", tokenizer)
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_gb=0.01, enable_prefix_caching=False)
    out = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 6
    from converter_parity import load_ours

    c = load_ours(path).config
    assert (c.architecture, c.num_layers, c.num_linear_layers, c.num_kv_heads, c.num_experts) == (
        real.arch, layers, shape.blocks.count("M"), 2, shape.experts)


def test_make_gguf_writes_a_mamba2_shape_with_fewer_layers(tmp_path, tokenizer):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from make_gguf import main

    out = tmp_path / "m.gguf"
    assert main([str(out), "--shape", "granite4-h-micro", "--layers", "6", "--mix", "Q4_0",
                 "--tokenizer-from", str(tokenizer)]) == 0
    m = GGUFFile(out).metadata
    assert (m["granitehybrid.block_count"], m["granitehybrid.attention.head_count_kv"]) == (6, [0, 0, 0, 0, 0, 8])
