"""Gemma 3 in the fused native stack (kernels/cpu/src/layer.c): Q/K norms, sandwich norms, GELU, sliding-window layers
with their own RoPE base, in one native call per step. On a Q8_0 GGUF at bfloat16 it gives the per-op path's hidden
states and K/V pool bit for bit, through prompt chunks and decodes that run past the window; the engine generates
the same tokens with it as without it, with the sliding layers in their own window pool and in the main one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.cpu.decoder import NativeDecoder
from edgeserve.loaders.gguf_file import GGUFFile
from edgeserve.loaders.gguf_weights import GGUFWeights
from edgeserve.models.config import config_from_gguf
from edgeserve.models.decoders import decoder_class

pytest.importorskip("transformers")
from test_cpu_decoder import STEPS, _native_on, run_steps  # noqa: E402,F401  (the fixture keeps the kernels on)
from test_more_archs import VOCAB, hf_model, write_gguf  # noqa: E402
from test_window_blocks import engine, generate  # noqa: E402
from support.fused_runs import fused_and_per_op, stub_loaded  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no native CPU kernels here")


def gemma_q8(path: Path):
    """Gemma 3 (7 layers, window 5, head size 16) as a Q8_0 GGUF, loaded at the CPU serving dtype."""
    g = GGUFFile(write_gguf(hf_model("gemma3"), "gemma3", path, q8_0=True))
    config = config_from_gguf(g.metadata, set(g.tensor_names()))
    model = decoder_class(config).from_weights(config, GGUFWeights(g, config.num_heads, config.num_kv_heads),
                                               dtype=torch.bfloat16)
    assert set(config.layer_windows) == {5, None} and config.rope_local_theta is not None
    return model


def test_gemma3_fused_stack_equals_the_per_op_path(tmp_path):
    model = gemma_q8(tmp_path / "g.gguf")
    plan = model.native_decoder()
    assert isinstance(plan, NativeDecoder) and plan.windowed
    fused, fused_pool = run_steps(model, True, STEPS)  # sequences of up to 42 positions: far past the window of 5
    per_op, per_op_pool = run_steps(model, False, STEPS)
    for step, (a, b) in enumerate(zip(fused, per_op)):
        assert torch.equal(a, b), f"step {step}: max diff {(a.float() - b.float()).abs().max().item()}"
    assert torch.equal(fused_pool.k, per_op_pool.k) and torch.equal(fused_pool.v, per_op_pool.v)


def test_gemma3_fused_stack_rows_do_not_depend_on_their_batch(tmp_path):
    model = gemma_q8(tmp_path / "g.gguf")
    together, _ = run_steps(model, True, [[(0, 9), (1, 30)], [(0, 1), (1, 1)]])
    alone, _ = run_steps(model, True, [[(1, 11), (1, 19)], [(1, 1)]])  # and its prompt in other chunks
    assert torch.equal(together[1][1], alone[1][0])


@pytest.mark.parametrize("window_pool", [True, False])
def test_gemma3_engine_tokens_are_the_same_fused_and_per_op(tmp_path, monkeypatch, window_pool):
    model = gemma_q8(tmp_path / "g.gguf")
    lm = stub_loaded(model, "tiny-gemma3-q8", tmp_path)
    prompts = [[(7 * i + 3) % VOCAB for i in range(23)], [(5 * i + 11) % VOCAB for i in range(13)]]
    outputs = fused_and_per_op(model, lambda: generate(engine(lm, window_pool, monkeypatch,
                                                              enable_prefix_caching=False), prompts, 30))
    assert len(set(outputs[0][0])) > 3  # not a degenerate repetition
