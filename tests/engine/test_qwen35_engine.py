"""A Qwen3.5 hybrid through the engine: its recurrent states live in seats of a state pool beside the paged KV
(one budget), so greedy outputs are the same batched or alone, chunked or whole, after preemption (recompute) and
beside a cancelled request; the pool is empty when the requests are done; a hybrid draft model is refused by name
(KV offload for hybrids: test_qwen35_offload)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgeserve.engine.core import EngineCore
from edgeserve.engine.config import EngineConfig
from edgeserve.engine.cache.state_pool import StateSpec
from edgeserve.llm import LLM
from edgeserve.sampling_params import SamplingParams

from qwen35_helpers import VOCAB, gguf_path, hf_qwen35, write_qwen35_gguf  # noqa: F401 (gguf_path: a fixture)
from support.hybrid_runs import assert_speculation_keeps_outputs

pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# KV of the one attention layer (2 heads of 32, float32) per block of 16 tokens, and one sequence's states
KV_BLOCK = 2 * 2 * 32 * 4 * 16


@pytest.fixture(scope="module")
def llm(gguf_path: Path) -> LLM:
    return LLM(str(gguf_path), dtype="float32", device="cpu", kv_cache_gb=0.01, enable_prefix_caching=False)


def prompts(*lens: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=n).tolist() for n in lens]


def ids(results) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


def assert_empty(engine: EngineCore) -> None:
    """Every seat is back; only prefix-cache snapshots may hold slots."""
    states = engine.states
    assert states is not None and states.num_seated == 0
    states.check()
    assert states.pool.num_used == states.num_snapshots


def test_outputs_do_not_depend_on_batching_or_chunking(llm: LLM) -> None:
    ps = prompts(5, 23, 40, 71)
    together = ids(llm.generate(ps, GREEDY))
    alone = [ids(llm.generate([p], GREEDY))[0] for p in ps]
    assert together == alone and all(len(t) == 12 for t in together)
    assert_empty(llm.engine)
    chunked = LLM.from_model(llm.lm, kv_cache_gb=0.01, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert ids(chunked.generate(ps, GREEDY)) == alone
    assert chunked.engine.stats().num_steps >= 71 // 16 + 11
    assert_empty(chunked.engine)


def test_state_slots_share_the_kv_budget_and_show_in_stats(llm: LLM) -> None:
    engine = llm.engine
    stats = engine.stats()
    per = engine.states.budget.bytes_per_slot
    spec = StateSpec(llm.lm.config.num_linear_layers, llm.lm.config.delta)
    assert per == spec.bytes_per_sequence == 3 * 4 * (3 * (2 * 2 * 16 + 4 * 8) + 4 * 16 * 8)
    assert stats.state_slots_total == engine.config.max_num_seqs and stats.state_slots_used == 0
    assert stats.state_bytes == engine.states.nbytes == (stats.state_slots_total + stats.state_snapshots_total) * per
    assert stats.kv_cache_bytes + stats.state_bytes <= 0.01 * 2**30
    assert engine.pool.k.shape[0] == 1  # only the full-attention layer keeps K/V


def test_preemption_recomputes_the_state(llm: LLM) -> None:
    """A budget of a few blocks: sequences are preempted (their seats given back) and recomputed."""
    ps = prompts(20, 26, 31, 17, seed=1)
    alone = [ids(llm.generate([p], GREEDY))[0] for p in ps]
    per = llm.engine.states.budget.bytes_per_slot
    budget = 8 * per + 5 * KV_BLOCK  # 4 seats (half the budget at most), the rest KV: 9 blocks
    small = LLM.from_model(llm.lm, kv_cache_gb=budget / 2**30, max_num_seqs=4, enable_prefix_caching=False)
    assert small.engine.scheduler.block_manager.num_blocks < 4 * 3
    assert ids(small.generate(ps, GREEDY)) == alone
    assert small.engine.stats().num_preemptions > 0
    assert_empty(small.engine)


def test_seats_limit_how_many_run_at_once(llm: LLM) -> None:
    """A budget of two seats runs four requests two at a time, with the same outputs."""
    ps = prompts(9, 14, 6, 11, seed=2)
    alone = [ids(llm.generate([p], GREEDY))[0] for p in ps]
    per = llm.engine.states.budget.bytes_per_slot
    tight = LLM.from_model(llm.lm, kv_cache_gb=5.5 * per / 2**30, enable_prefix_caching=False)
    seats = tight.engine.states.budget.seats
    assert seats == 2
    engine = tight.engine
    rids = [engine.add_request(p, GREEDY) for p in ps]
    most = 0
    outs: dict[str, list[int]] = {r: [] for r in rids}
    while engine.has_work():
        for o in engine.step():
            outs[o.request_id] += o.token_ids
        most = max(most, engine.states.num_seated)
        assert engine.states.num_seated <= seats
    assert most == seats and [outs[r] for r in rids] == alone
    assert_empty(engine)


def test_cancel_returns_the_seat_in_the_same_step(llm: LLM) -> None:
    ps = prompts(12, 30, 8, seed=3)
    alone = [ids(llm.generate([p], GREEDY))[0] for p in ps]
    check_cancel_returns_the_seat(llm.engine, ps, alone, GREEDY)


def check_cancel_returns_the_seat(engine: EngineCore, ps: list[list[int]], alone: list[list[int]],
                                  params: SamplingParams) -> None:
    """Three requests seated; the middle one finished after three steps: its seat is free after the next step, and
    the other two end with their tokens alone (`alone`, under `params`)."""
    rids = [engine.add_request(p, params) for p in ps[:3]]
    outs: dict[str, list[int]] = {r: [] for r in rids}
    for _ in range(3):
        for o in engine.step():
            outs[o.request_id] += o.token_ids
    assert engine.states.num_seated == 3
    engine.finish_request(rids[1])
    for o in engine.step():
        outs[o.request_id] += o.token_ids
    assert engine.states.num_seated == 2 and not engine.states.has_seat(rids[1])
    while engine.has_work():
        for o in engine.step():
            outs[o.request_id] += o.token_ids
    assert outs[rids[0]] == alone[0] and outs[rids[2]] == alone[2]
    assert_empty(engine)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_speculation_rolls_the_state_back(llm: LLM, prefix_caching: bool) -> None:
    """Speculation on a hybrid: greedy outputs equal plain decoding's whether drafts are accepted whole, in part or
    not at all (a rejection puts the state back to before the step; the accepted tokens are computed again)."""
    ps = prompts(13, 29, 40, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = [ids(llm.generate([p], params))[0] for p in ps]
    spec = assert_speculation_keeps_outputs(llm.lm, ps, plain, params, prefix_caching)
    assert spec.engine.states.budget.backups == spec.engine.states.budget.seats
    assert [ids(spec.generate([p], params))[0] for p in ps] == plain
    assert spec.engine.stats().spec_mean_accepted_length > 1.5
    assert_empty(spec.engine)
    # prompt lookup itself (its drafts mostly rejected by this model) gives the same outputs
    lookup = LLM.from_model(llm.lm, kv_cache_gb=0.01, speculative="ngram", enable_prefix_caching=prefix_caching)
    assert ids(lookup.generate(ps, params)) == plain and lookup.engine.stats().spec_proposed_tokens > 0


def test_a_hybrid_draft_model_is_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="hybrid draft model \\(qwen35\\) is not supported"):
        EngineCore(llm.lm, EngineConfig(kv_cache_gb=0.01, speculative="draft", draft_model="x"), draft=llm.lm)


def test_moe_gguf_in_block_formats_runs_natively_in_bfloat16(tmp_path: Path) -> None:
    """A qwen35moe GGUF with Q8_0 matrices and experts in bfloat16 on the CPU: the matrices (attention q / k rows
    permuted for partial RoPE) stay in block format on the native kernels; outputs are the same batched or alone and
    close to the float32 model's."""
    from edgeserve.kernels.cpu import native as cpu_native
    from edgeserve.kernels.cpu.native import BlockWeight

    if not cpu_native.available():
        pytest.skip("the native CPU kernels are not built here")
    model = hf_qwen35(moe=True)
    path = write_qwen35_gguf(model, tmp_path / "moe.gguf", "Q8_0")
    llm = LLM(str(path), dtype="bfloat16", device="cpu", kv_cache_gb=0.01, enable_prefix_caching=False)
    layers = llm.lm.model.layers
    assert isinstance(layers[3].qkv, BlockWeight) and isinstance(layers[0].in_proj, BlockWeight)
    ps = prompts(7, 19, 33, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    together = ids(llm.generate(ps, params))
    assert together == [ids(llm.generate([p], params))[0] for p in ps]
    assert_empty(llm.engine)
    # the first token of each is among the top 5 of the float32 model of the same (rounded) values
    exact = LLM(str(write_qwen35_gguf(model, tmp_path / "f32.gguf", rounded="Q8_0")), dtype="float32", device="cpu",
                kv_cache_gb=0.01, enable_prefix_caching=False)
    lp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=5)
    for p in ps:
        a = llm.generate([p], lp)[0].outputs[0]
        b = exact.generate([p], lp)[0].outputs[0]
        assert a.token_ids[0] in [t for t, _ in b.logprobs[0].top]


def test_metrics_and_api_ps_show_the_state_slots(llm: LLM) -> None:
    from types import SimpleNamespace

    from edgeserve.server.metrics import _EngineCollector
    from edgeserve.server.api.ollama_models import _ps_entry

    entry = SimpleNamespace(id="q35", state="loaded", engine=llm.engine, expires_in=lambda: None, size_bytes=1,
                            active=0, load_seconds=0.5)
    metrics = {m.name: m.samples[0].value for m in _EngineCollector(SimpleNamespace(entries={"q35": entry})).collect()
               if m.samples}
    stats = llm.engine.stats()
    assert metrics["edgeserve_state_slots_total"] == stats.state_slots_total > 0
    assert metrics["edgeserve_state_bytes"] == stats.state_bytes > 0
    assert metrics["edgeserve_prompt_tokens_from_states"] == stats.prompt_tokens_from_states
    ps = _ps_entry(entry, "loaded", False, "", {})
    assert ps["recurrent_state"] == {"slots": stats.state_slots_total, "slots_used": 0,
                                     "snapshots": stats.state_snapshots, "bytes": stats.state_bytes}


def test_one_step_overlap_with_prefix_caching(llm: LLM) -> None:
    """The next step launched before the last one's tokens are on the host (the CUDA default, here on the CPU): the
    same outputs, and the snapshots taken meanwhile serve a second turn."""
    ps = prompts(21, 40, 9, seed=7)
    alone = [ids(llm.generate([p], GREEDY))[0] for p in ps]
    overlap = LLM.from_model(llm.lm, kv_cache_gb=0.01, overlap="on")
    assert overlap.engine.overlap and ids(overlap.generate(ps, GREEDY)) == alone
    second = ps[1] + alone[1] + [5, 6, 7]
    before = overlap.engine.stats().prompt_tokens_reused
    assert ids(overlap.generate([second], GREEDY)) == ids(llm.generate([second], GREEDY))
    assert overlap.engine.stats().prompt_tokens_reused - before == 48
    assert_empty(overlap.engine)
