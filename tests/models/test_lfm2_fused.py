"""LFM2, LFM2-MoE and LFM3 in the fused native stack (kernels/cpu/src/layer.c, planned by
models.archs.lfm2.native_plan and models.archs.lfm3.native_plan): gated short-conv mixer blocks over the state pool's
conv slots in place, attention with per-head Q/K norms (LFM3's: sliding-window layers with their own RoPE tables,
global ones with proportional RoPE, a sigmoid gate per head, sandwich norms), the SwiGLU MLP, in one native call per
step. Each module-fixture test runs for LFM2 and LFM3. On a Q8_0 GGUF at bfloat16 the stack gives the per-op path's
hidden states (so its logits), K/V pool and conv states bit for bit through prompt chunks and decodes beside other
sequences; through the engine its greedy tokens are the per-op path's, batched, chunked, alone, on a prefix-cache hit
and under speculation with drafts rolled back. LFM2-MoE (its expert layers: moe_layer.c's sigmoid router with the
expert bias, at layer_t.moe) the same way, on llama.cpp's Q8_0 conversion."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from converter_parity import load_ours  # noqa: E402
from hybrid_helpers import (GREEDY, assert_empty, check_second_turn_resumes, ids, make_checkpoint,  # noqa: E402
                            prompts)
from support.fused_runs import BLOCK, IDS, STEPS, fused_and_per_op, run_hybrid_steps  # noqa: E402
from support.gguf_writer import write_model_gguf  # noqa: E402
from support.hybrid_runs import assert_speculation_keeps_outputs  # noqa: E402

from edgeserve.engine.cache.kv_cache import KVPool  # noqa: E402
from edgeserve.engine.cache.state_pool import StatePool, state_spec_for  # noqa: E402
from edgeserve.kernels.cpu import native as cpu_native  # noqa: E402
from edgeserve.kernels.cpu.decoder import NativeDecoder  # noqa: E402
from edgeserve.llm import LLM  # noqa: E402
from edgeserve.models.archs.lfm2.native_plan import build_lfm2  # noqa: E402
from edgeserve.models.archs.lfm3.native_plan import build_lfm3  # noqa: E402
from edgeserve.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no native CPU kernels here")


@pytest.fixture(scope="module", params=["lfm2", "lfm3"])
def lm(request, default_model_path, tmp_path_factory):
    """The tiny LFM2 (LFM3) of the converter case as our Q8_0 GGUF, loaded at the default dtype (bfloat16)."""
    arch = request.param
    model, folder = make_checkpoint(arch, default_model_path, tmp_path_factory)
    loaded = load_ours(write_model_gguf(model, folder.parent / f"{arch}.q8_0.gguf", arch, qtype="Q8_0"),
                       dtype="auto")
    assert loaded.model.dtype == torch.bfloat16 and isinstance(loaded.model.native_decoder(), NativeDecoder)
    return loaded


def run_steps(model, fused: bool, steps=STEPS, seqs=IDS):
    """Hidden states of each step, the K/V pool and the state pool after `steps`, fused or per-op. Sequence j owns
    blocks 8j .. 8j + 7 and state slot j."""
    model._native = False if fused else None  # False: plan on the next forward; None: the per-op path
    c = model.config
    pool = KVPool(c, 32, BLOCK, model.dtype)
    states = StatePool(state_spec_for(c), len(seqs))
    hidden = run_hybrid_steps(model, pool, states, steps, seqs, BLOCK)
    assert (model._native is not None) == fused
    return hidden, pool, states


def test_lfm2_fused_stack_equals_the_per_op_path(lm):
    model = lm.model
    plan = model.native_decoder()
    convs = [i for i, layer in enumerate(model.layers) if layer.conv is not None]
    assert convs and all(plan.layers[i].mixer.conv for i in convs)  # the conv layers are mixer blocks
    if model.config.architecture == "lfm3":  # its attention options and sandwich norms are in the plan
        attention = [(i, layer) for i, layer in enumerate(model.layers) if layer.conv is None]
        assert all(plan.layers[i].attn.head_gate == 1 and plan.layers[i].attn.window == (layer.window or 0) and
                   plan.layers[i].attn.local_rope == (layer.window is not None) for i, layer in attention)
        assert {layer.window for _, layer in attention} == {None, 5} and plan.windowed and plan.min_window == 5
        assert all(plan.layers[i].norms.mix_out and plan.layers[i].norms.ffn_out for i in range(len(model.layers)))
    fused, fused_kv, fused_states = run_steps(model, True)
    per_op, per_op_kv, per_op_states = run_steps(model, False)
    for step, (a, b) in enumerate(zip(fused, per_op)):
        assert a.dtype == b.dtype == torch.bfloat16
        assert torch.equal(a, b), f"step {step}: max diff {(a.float() - b.float()).abs().max().item()}"
    assert torch.equal(model.logits(fused[-1]), model.logits(per_op[-1]))
    assert torch.equal(fused_kv.k, per_op_kv.k) and torch.equal(fused_kv.v, per_op_kv.v)
    assert torch.equal(fused_states.conv, per_op_states.conv) and fused_states.conv.abs().sum() > 0


def test_lfm2_fused_rows_do_not_depend_on_their_batch_or_chunks(lm):
    model = lm.model
    together, _, _ = run_steps(model, True, [[(0, 13), (0, 9)], [(13, 14), (9, 10)]])
    alone, _, _ = run_steps(model, True, [[(0, 0), (0, 4)], [(0, 0), (4, 9)], [(0, 0), (9, 10)]])
    assert torch.equal(together[1][1], alone[2][0])
    whole, _, _ = run_steps(model, True, [[(0, 13)], [(13, 14)]])
    chunked, _, _ = run_steps(model, True, [[(0, 1)], [(1, 6)], [(6, 13)], [(13, 14)]])
    assert torch.equal(whole[-1], chunked[-1]) and torch.equal(whole[0][-1], chunked[2][-1])


def assert_engine_tokens_fused_equal_per_op(loaded, ps: list, varied: int) -> None:
    """Greedy tokens through the engine on the fused stack equal the per-op path's, batched, chunked and alone
    (prompt `varied`'s output not a degenerate repetition)."""
    llm = LLM.from_model(loaded, kv_cache_gb=0.01, enable_prefix_caching=False)
    chunked = LLM.from_model(loaded, kv_cache_gb=0.01, max_num_batched_tokens=16, enable_prefix_caching=False)
    alone = fused_and_per_op(loaded.model, lambda: [ids(llm.generate([p], GREEDY))[0] for p in ps])[0]
    assert len(set(alone[varied])) > 2
    assert fused_and_per_op(loaded.model, lambda: ids(llm.generate(ps, GREEDY)))[0] == alone
    assert fused_and_per_op(loaded.model, lambda: ids(chunked.generate(ps, GREEDY)))[0] == alone
    assert_empty(llm)
    assert_empty(chunked)


def test_lfm2_engine_tokens_fused_equal_per_op_batched_chunked_alone(lm):
    assert_engine_tokens_fused_equal_per_op(lm, prompts(5, 23, 40, 71), 3)


def test_lfm2_prefix_hit_and_speculation_fused(lm):
    """A second turn resumes from the first's conv-state snapshot, and speculation rolls the conv states back, on
    the fused stack, with the per-op path's tokens."""
    lm.model._native = False
    llm = LLM.from_model(lm, kv_cache_gb=0.01, enable_prefix_caching=False)
    check_second_turn_resumes(llm)
    ps = prompts(13, 29, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    lm.model._native = None
    plain = [ids(llm.generate([p], params))[0] for p in ps]
    lm.model._native = False
    spec = assert_speculation_keeps_outputs(lm, ps, plain, params, prefix_caching=True)
    assert isinstance(lm.model._native, NativeDecoder)
    assert_empty(spec)


@pytest.mark.parametrize("arch,build", [("lfm2", build_lfm2), ("lfm3", build_lfm3)])
def test_lfm2_unquantized_matrices_stay_per_op(default_model_path, tmp_path_factory, arch, build):
    model, folder = make_checkpoint(arch, default_model_path, tmp_path_factory)
    f32 = load_ours(write_model_gguf(model, folder.parent / f"{arch}.f32.gguf", arch, qtype="F32"), dtype="auto")
    assert build(f32.model) is None  # not block formats


@pytest.fixture(scope="module")
def moe_lm(default_model_path, tmp_path_factory):
    """The tiny LFM2-MoE of the converter case as llama.cpp's Q8_0 conversion, at the default dtype (bfloat16)."""
    from converter_parity import convert

    _, folder = make_checkpoint("lfm2moe", default_model_path, tmp_path_factory)
    loaded = load_ours(convert(folder, folder.parent / "lfm2moe.q8_0.gguf", outtype="q8_0"), dtype="auto")
    assert loaded.model.dtype == torch.bfloat16 and isinstance(loaded.model.native_decoder(), NativeDecoder)
    return loaded


def test_lfm2_moe_fused_stack_equals_the_per_op_path(moe_lm):
    model = moe_lm.model
    plan = model.native_decoder()
    experts = [i for i, layer in enumerate(model.layers) if layer.moe is not None]
    assert experts and all(plan.layers[i].moe == model.layers[i].moe.native().address() for i in experts)
    assert all(model.layers[i].moe.native().struct.route == 2 for i in experts)  # ROUTE_SIGMOID_BIAS
    fused, fused_kv, fused_states = run_steps(model, True)
    per_op, per_op_kv, per_op_states = run_steps(model, False)
    for step, (a, b) in enumerate(zip(fused, per_op)):
        assert torch.equal(a, b), f"step {step}: max diff {(a.float() - b.float()).abs().max().item()}"
    assert torch.equal(fused_kv.k, per_op_kv.k) and torch.equal(fused_states.conv, per_op_states.conv)
    # the expert bias reaches the stack: without it, other experts and other states
    for i in experts:
        model.layers[i].moe.native().struct.choice_bias = None
    try:
        changed, _, _ = run_steps(model, True, STEPS[:1])
    finally:
        for i in experts:
            model.layers[i].moe._native = False  # planned again, with its bias, on the next use
        model._native = False
    assert not torch.equal(changed[0], fused[0])


def test_lfm2_moe_engine_tokens_fused_equal_per_op_batched_chunked_alone(moe_lm):
    assert_engine_tokens_fused_equal_per_op(moe_lm, prompts(5, 23, 40, seed=3), 2)
