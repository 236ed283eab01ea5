"""Qwen3.5 (dense) in the fused native stack (kernels/cpu/src/layer.c, planned by models.archs.qwen35.native_plan): Gated
DeltaNet layers over the state pool's slots in place, gated attention with per-head Q/K norms and partial RoPE, in one
native call per step. On a Q8_0 GGUF it gives the per-op path's hidden states, K/V pool and recurrent states bit for
bit through prompt chunks and decodes beside other sequences; a row's result does not depend on its batch or on how
its prompt was chunked; through the engine the tokens are the per-op path's batched, chunked, after preemption,
beside a cancel, on a prefix-cache hit and under speculation, and the state pool ends empty. qwen35moe runs fused too
(its MoE feed-forwards, shared expert included, as moe_layer.c plans at layer_t.moe), bit for bit the per-op path's."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from edgeserve.engine.cache.kv_cache import KVPool
from edgeserve.engine.cache.kv_format import Q8_0
from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.cpu.decoder import NativeDecoder
from edgeserve.models.archs.qwen35.native_plan import build_qwen35
from edgeserve.llm import LLM
from edgeserve.loaders.gguf_file import GGUFFile
from edgeserve.loaders.gguf_weights import GGUFWeights
from edgeserve.models.config import config_from_gguf
from edgeserve.models.qwen35 import Qwen35Model
from edgeserve.sampling_params import SamplingParams

pytest.importorskip("transformers")
from qwen35_helpers import hf_qwen35, state_pool, write_qwen35_gguf  # noqa: E402
from test_cpu_decoder import _native_on  # noqa: E402,F401  (the fixture keeps the kernels on)
from support.fused_runs import BLOCK, IDS, STEPS, run_hybrid_steps  # noqa: E402
from support.hybrid_runs import assert_speculation_keeps_outputs  # noqa: E402
from test_qwen35_engine import assert_empty, check_cancel_returns_the_seat, ids, prompts  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no native CPU kernels here")
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def load(path: Path, dtype: torch.dtype = torch.bfloat16, moe: bool = False, qtype: str = "Q8_0") -> Qwen35Model:
    """The tiny Qwen3.5 as a GGUF of `qtype` matrices, loaded on the CPU at `dtype`."""
    g = GGUFFile(write_qwen35_gguf(hf_qwen35(moe), path, qtype))
    config = config_from_gguf(g.metadata, set(g.tensor_names()))
    return Qwen35Model.from_weights(config, GGUFWeights(g, config.num_heads, config.num_kv_heads), dtype=dtype)


def run_steps(model: Qwen35Model, fused: bool | NativeDecoder, steps=STEPS, ids=IDS, kv=None):
    """Hidden states of each step, the K/V pool and the state pool after `steps` (see STEPS), fused or per-op.
    Sequence j owns blocks 8j .. 8j + 7 and state slot j."""
    # False: plan on the next forward; None: the per-op path; or this plan
    model._native = fused if isinstance(fused, NativeDecoder) else (False if fused else None)
    c = model.config
    pool = KVPool(c, 32, BLOCK, model.dtype if kv is None else kv)
    states = state_pool(c, len(ids))
    hidden = run_hybrid_steps(model, pool, states, steps, ids, BLOCK)
    assert (model._native is not None) == bool(fused)
    return hidden, pool, states


@pytest.mark.parametrize("kv,moe", [(None, False), (Q8_0, False), (None, True), (Q8_0, True)],
                         ids=["bf16-kv", "q8_0-kv", "moe-bf16-kv", "moe-q8_0-kv"])
def test_qwen35_fused_stack_equals_the_per_op_path(tmp_path, kv, moe):
    model = load(tmp_path / "q.gguf", moe=moe)
    plan = model.native_decoder()
    assert isinstance(plan, NativeDecoder)
    if moe:  # every feed-forward is a moe_layer.c plan, the shared expert inside it, kept alive by the plan
        assert len(plan.moe) == len(model.layers) and all(p.has_shared for p in plan.moe)
        assert [plan.layers[i].moe for i in range(len(model.layers))] == [p.address() for p in plan.moe]
    fused, fused_kv, fused_states = run_steps(model, True, kv=kv)
    per_op, per_op_kv, per_op_states = run_steps(model, False, kv=kv)
    for step, (a, b) in enumerate(zip(fused, per_op)):
        assert a.dtype == b.dtype == model.act_dtype == torch.float32  # the normed rows stay float32 on the CPU
        assert torch.equal(a, b), f"step {step}: max diff {(a.float() - b.float()).abs().max().item()}"
    assert torch.equal(fused_kv.k, per_op_kv.k) and torch.equal(fused_kv.v, per_op_kv.v)
    assert torch.equal(fused_states.conv, per_op_states.conv)
    assert torch.equal(fused_states.recurrent, per_op_states.recurrent)
    assert fused_states.recurrent.abs().sum() > 0  # the states were written


def test_qwen35_fused_rows_do_not_depend_on_their_batch_or_chunks(tmp_path):
    model = load(tmp_path / "q.gguf")
    together, _, _ = run_steps(model, True, [[(0, 13), (0, 9)], [(13, 14), (9, 10)]])
    alone, _, _ = run_steps(model, True, [[(0, 0), (0, 4)], [(0, 0), (4, 9)], [(0, 0), (9, 10)]])
    assert torch.equal(together[1][1], alone[2][0])
    whole, _, _ = run_steps(model, True, [[(0, 13)], [(13, 14)], [(14, 15)]])
    chunked, _, _ = run_steps(model, True, [[(0, 1)], [(1, 6)], [(6, 13)], [(13, 14)], [(14, 15)]])
    assert torch.equal(whole[-1], chunked[-1]) and torch.equal(whole[-2], chunked[-2])
    assert torch.equal(whole[0][-1], chunked[2][-1])


def test_qwen35_unquantized_matrices_stay_per_op(tmp_path):
    assert build_qwen35(load(tmp_path / "moe.gguf", moe=True, qtype="F32")) is None  # experts not block formats
    assert build_qwen35(load(tmp_path / "f32.gguf", qtype="F32")) is None  # not block formats
    assert build_qwen35(load(tmp_path / "q8.gguf", torch.float32)) is None  # float32: exact, not block formats
    model = load(tmp_path / "q.gguf")
    per_op, _, _ = run_steps(model, False, STEPS[:2])
    plan = build_qwen35(model)
    plan.recurrent.num_layers = 7  # state pools of another shape: the plan declines the step
    plan.forward = None  # (a step that took it would fail)
    assert all(torch.equal(a, b) for a, b in zip(run_steps(model, plan, STEPS[:2])[0], per_op))


@pytest.fixture(scope="module")
def fused_llm(tmp_path_factory) -> LLM:
    path = write_qwen35_gguf(hf_qwen35(), tmp_path_factory.mktemp("qwen35") / "q8.gguf", "Q8_0")
    llm = LLM(str(path), dtype="bfloat16", device="cpu", kv_cache_gb=0.01, enable_prefix_caching=False)
    assert isinstance(llm.lm.model.native_decoder(), NativeDecoder)
    return llm


@contextmanager
def per_op(llm: LLM):
    """The model on its per-op path inside the block (the fused stack planned again after)."""
    llm.lm.model._native = None
    try:
        yield
    finally:
        llm.lm.model._native = False


def check_batched_and_chunked(llm: LLM, ps: list[list[int]], alone: list[list[int]]) -> None:
    """`ps` generated together, and again in 16-token prompt chunks, give their tokens alone (`alone`), every
    state seat back afterwards."""
    assert ids(llm.generate(ps, GREEDY)) == alone and len(set(alone[3])) > 2
    assert_empty(llm.engine)
    chunked = LLM.from_model(llm.lm, kv_cache_gb=0.01, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert ids(chunked.generate(ps, GREEDY)) == alone
    assert_empty(chunked.engine)


def test_qwen35_engine_tokens_are_the_per_op_paths(fused_llm):
    """Batched, chunked, preempted, beside a cancel: the fused stack's tokens are the per-op path's alone."""
    ps = prompts(5, 23, 40, 71)
    with per_op(fused_llm):
        alone = [ids(fused_llm.generate([p], GREEDY))[0] for p in ps]
    check_batched_and_chunked(fused_llm, ps, alone)
    per = fused_llm.engine.states.budget.bytes_per_slot
    small = LLM.from_model(fused_llm.lm, kv_cache_gb=8 * per / 2**30, max_num_seqs=4, enable_prefix_caching=False)
    assert 6 <= small.engine.scheduler.block_manager.num_blocks < 14  # the longest fits; all four at once do not
    grow = prompts(20, 26, 31, 17, seed=1)  # admitted together; their decodes then outgrow the pool
    with per_op(fused_llm):
        grow_alone = [ids(fused_llm.generate([p], GREEDY))[0] for p in grow]
    assert ids(small.generate(grow, GREEDY)) == grow_alone and small.engine.stats().num_preemptions > 0
    assert_empty(small.engine)
    check_cancel_returns_the_seat(fused_llm.engine, ps, alone, GREEDY)


def test_qwen35_engine_prefix_hit_and_speculation_fused(fused_llm):
    """A second turn resumes from the first's state snapshot, and speculation rolls states back, in the fused
    stack, with the per-op path's tokens."""
    first = prompts(45, seed=1)[0]
    with per_op(fused_llm):
        reply = ids(fused_llm.generate([first], GREEDY))[0]
        second = first + reply + prompts(9, seed=2)[0]
        cold = ids(fused_llm.generate([second], GREEDY))[0]
    warm = LLM.from_model(fused_llm.lm, kv_cache_gb=0.01)
    assert ids(warm.generate([first], GREEDY))[0] == reply
    before = warm.engine.stats().prompt_tokens_reused
    assert ids(warm.generate([second], GREEDY))[0] == cold
    assert warm.engine.stats().prompt_tokens_reused - before == 48
    assert_empty(warm.engine)
    ps = prompts(13, 29, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with per_op(fused_llm):
        plain = [ids(fused_llm.generate([p], params))[0] for p in ps]
    spec = assert_speculation_keeps_outputs(fused_llm.lm, ps, plain, params, prefix_caching=True)
    assert isinstance(fused_llm.lm.model._native, NativeDecoder)
    assert_empty(spec.engine)


def test_qwen35moe_engine_tokens_are_the_per_op_paths(tmp_path):
    """qwen35moe through the engine, batched and chunked: the fused stack's tokens are the per-op path's alone."""
    path = write_qwen35_gguf(hf_qwen35(moe=True), tmp_path / "moe.gguf", "Q8_0")
    llm = LLM(str(path), dtype="bfloat16", device="cpu", kv_cache_gb=0.01, enable_prefix_caching=False)
    assert isinstance(llm.lm.model.native_decoder(), NativeDecoder)
    ps = prompts(5, 23, 40, 71)
    with per_op(llm):
        alone = [ids(llm.generate([p], GREEDY))[0] for p in ps]
    check_batched_and_chunked(llm, ps, alone)
    assert isinstance(llm.lm.model._native, NativeDecoder)
