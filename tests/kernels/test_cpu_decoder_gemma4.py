"""Gemma 4 in the fused native stack (kernels/cpu/src/layer.c, planned by models.archs.gemma4.native_plan): per-layer head
sizes (16 sliding, 32 global) and K/V heads, a weightless V norm, attention scale 1, proportional RoPE, KV-shared
layers, the E models' per-layer inputs, the layer output scales and the 31B's V = K global layers, in one native
call per step. On a Q8_0 GGUF at
bfloat16 it gives the per-op path's hidden states and K/V pool bit for bit, through prompt chunks and decodes past
the window; a row's result does not depend on its batch; the engine generates the same tokens fused and per-op."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.cpu.decoder import NativeDecoder
from edgeserve.kernels.cpu.native import BlockWeight
from edgeserve.loaders.gguf_file import GGUFFile
from edgeserve.loaders.gguf_weights import GGUFWeights
from edgeserve.models.config import config_from_gguf
from edgeserve.models.archs.gemma4.model import Gemma4Model
from edgeserve.models.load import LoadedModel

pytest.importorskip("transformers")
from test_cpu_decoder import STEPS, _native_on, run_steps  # noqa: E402,F401  (the fixture keeps the kernels on)
from test_gemma4 import VOCAB, hf_model, write_gguf  # noqa: E402
from test_window_blocks import engine, generate  # noqa: E402
from support.fused_runs import fused_and_per_op, stub_loaded  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no native CPU kernels here")

# E2B-shaped with a per-layer input width of whole Q8_0 blocks (32), so every matrix runs in the stack; and the
# 31B shape (no per-layer inputs or KV-shared layers; global layers with V = K and 1 K/V head, sliding ones 2)
SHAPES = {"e2b": dict(hidden_size_per_layer_input=32), "31b": {}}


def gemma4_q8(path: Path, shape: str) -> Gemma4Model:
    """The tiny Gemma 4 of `shape` as a Q8_0 GGUF, loaded at the CPU serving dtype."""
    g = GGUFFile(write_gguf(hf_model(shape, **SHAPES[shape]), path, q8_0=True))
    config = config_from_gguf(g.metadata, set(g.tensor_names()))
    model = Gemma4Model.from_weights(config, GGUFWeights(g, config.num_heads, config.num_kv_heads),
                                     dtype=torch.bfloat16)
    assert all(isinstance(layer.qkv, BlockWeight) for layer in model.layers)
    return model


@pytest.mark.parametrize("shape", ["e2b", "31b"])
def test_gemma4_fused_stack_equals_the_per_op_path(tmp_path, shape):
    model = gemma4_q8(tmp_path / "g.gguf", shape)
    c = model.config
    if shape == "e2b":
        assert c.per_layer_input_size == 32 and c.kv_shared_layers == 3
        assert any(layer.scale != 1.0 for layer in model.layers)
    else:
        assert c.per_layer_input_size == 0 and c.global_k_eq_v
        assert {layer.kv_heads for layer in model.layers} == {1, 2}
    plan = model.native_decoder()
    assert isinstance(plan, NativeDecoder) and plan.windowed
    fused, fused_pool = run_steps(model, True, STEPS)  # sequences of up to 42 positions: far past the window of 5
    per_op, per_op_pool = run_steps(model, False, STEPS)
    assert fused_pool.window_k.shape[0] > 0  # the sliding layers kept apart for their head size
    for step, (a, b) in enumerate(zip(fused, per_op)):
        assert torch.equal(a, b), f"step {step}: max diff {(a.float() - b.float()).abs().max().item()}"
        assert torch.equal(model.logits(a), model.logits(b))
    for name in ("k", "v", "window_k", "window_v"):
        assert torch.equal(getattr(fused_pool, name), getattr(per_op_pool, name)), name


def test_gemma4_fused_stack_rows_do_not_depend_on_their_batch(tmp_path):
    model = gemma4_q8(tmp_path / "g.gguf", "e2b")
    together, _ = run_steps(model, True, [[(0, 9), (1, 30)], [(0, 1), (1, 1)]])
    alone, _ = run_steps(model, True, [[(1, 11), (1, 19)], [(1, 1)]])  # and its prompt in other chunks
    assert torch.equal(together[1][1], alone[1][0])


@pytest.mark.parametrize("window_pool", [True, False])
def test_gemma4_engine_tokens_are_the_same_fused_and_per_op(tmp_path, monkeypatch, window_pool):
    model = gemma4_q8(tmp_path / "g.gguf", "e2b")
    lm = stub_loaded(model, "tiny-gemma4-q8", tmp_path)
    prompts = [[(7 * i + 3) % VOCAB for i in range(23)], [(5 * i + 11) % VOCAB for i in range(13)]]
    outputs = fused_and_per_op(model, lambda: generate(engine(lm, window_pool, monkeypatch,
                                                              enable_prefix_caching=False), prompts, 20))
    assert len(set(outputs[0][0])) > 3  # not a degenerate repetition


def test_gemma4_chunked_prompt_equals_whole_through_the_engine(tmp_path, monkeypatch):
    """Greedy tokens from the fused stack with the prompt in chunks of 16 tokens and in one step agree."""
    model = gemma4_q8(tmp_path / "g.gguf", "e2b")
    tokenizer = SimpleNamespace(eot_ids=frozenset(), decode=lambda ids: "", byte_fallback_ids=frozenset())
    lm = LoadedModel("tiny-gemma4-q8", SimpleNamespace(path=tmp_path), model.config, model, tokenizer, None, 0.0)
    prompt = [[(3 * i + 5) % VOCAB for i in range(40)]]
    chunked = generate(engine(lm, True, monkeypatch, enable_prefix_caching=False), prompt, 12)
    whole = generate(engine(lm, True, monkeypatch, enable_prefix_caching=False, max_num_batched_tokens=64), prompt, 12)
    assert isinstance(model._native, NativeDecoder)
    assert chunked == whole


def test_per_layer_input_mix_native_matches_its_torch_twin():
    """kernels' scaled_norm_add (Gemma 4's per-layer inputs, one native pass on CPU) against its torch twin."""
    from edgeserve.kernels.torch import norm
    from edgeserve.kernels.dispatch import scaled_norm_add

    torch.manual_seed(0)
    x, y, weight = torch.randn(70, 256) * 3, torch.randn(70, 256), torch.rand(256) + 0.5
    got = scaled_norm_add(x, y, weight, 1e-6, 0.03, 16.0, 2.0 ** -0.5)
    want = norm.scaled_norm_add(x, y, weight, 1e-6, 0.03, 16.0, 2.0 ** -0.5)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, norm.scaled_norm_add(x, y, weight, 1e-6, 0.03, 1.0, 2.0 ** -0.5))


def test_logit_softcap_native_matches_torch():
    """The final logit soft-capping (one native pass on CPU) is torch's tanh(x / cap) * cap, over several chunks."""
    from edgeserve.kernels.dispatch import softcap

    x = torch.randn(3, 40_000) * 40
    got = softcap(x, 30.0)
    assert torch.allclose(got, torch.tanh(x / 30.0) * 30.0, rtol=1e-5, atol=1e-4)
    assert got.abs().max() < 30.0 < x.abs().max() and not torch.equal(got, x)


@pytest.mark.parametrize("shape", ["e2b", "26b-a4b"])
def test_bf16_block_matmuls_read_float32_activations(tmp_path, monkeypatch, shape):
    """At bfloat16 on the CPU, a Q8_0 file's matmuls (which quantize their input to int8 blocks themselves) and the
    26B-A4B's experts read the float32 normed rows, not a bf16 copy of them, per op (every layer's norms, the E
    models' per-layer inputs) and in the fused stack (issue 54: a bf16 copy first rounds twice; llama.cpp keeps
    them float32)."""
    from edgeserve.models.moe import MoELayer

    g = GGUFFile(write_gguf(hf_model(shape, **SHAPES.get(shape, {})), tmp_path / "g.gguf", q8_0=True))
    config = config_from_gguf(g.metadata, set(g.tensor_names()))
    model = Gemma4Model.from_weights(config, GGUFWeights(g, config.num_heads, config.num_kv_heads),
                                     dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model.act_dtype == torch.float32
    assert all(isinstance(layer.qkv, BlockWeight) for layer in model.layers)
    assert (config.per_layer_input_size > 0) == (shape == "e2b") and config.is_moe == (shape == "26b-a4b")
    seen: list[torch.dtype] = []
    matmul, mix = BlockWeight.matmul, MoELayer.mix
    monkeypatch.setattr(BlockWeight, "matmul", lambda self, x, out=None: seen.append(x.dtype) or matmul(self, x, out))
    monkeypatch.setattr(MoELayer, "mix", lambda self, h, w, e: seen.append(h.dtype) or mix(self, h, w, e))
    # the per-op path over the served pool (float16: float32 queries and attention outputs; a bf16 pool's are bf16)
    hidden, _ = run_steps(model, False, [[(0, 9)], [(0, 1)]], torch.float16)
    assert len(seen) > 4 * len(model.layers) and set(seen) == {torch.float32}
    assert hidden[0].dtype == torch.float32
    if shape == "e2b":  # the fused stack (the 26B-A4B's experts run per op)
        model._native = False  # planned again
        plan = model.native_decoder()
        assert isinstance(plan, NativeDecoder) and plan.decoder.act_bf16 == 0 and plan.act_dtype == torch.float32
