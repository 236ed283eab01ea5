"""One request state: the engine core, the scheduler, the block manager and the input batch keep each request in
one registry by id (its block table and batch row are parts of it), and its token ids are held once."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from edgeserve.engine.sched.request_state import Registry, Request, Sequence
from edgeserve.llm import LLM
from edgeserve.sampling_params import SamplingParams

TINY = Path(__file__).resolve().parents[3] / "benchmarks" / "configs" / "tiny-llama.json"


def test_a_part_view_sets_reads_and_clears_one_attribute_of_registered_requests():
    reg = Registry()
    reg["a"], reg["b"] = Sequence("a", [1, 2]), Sequence("b", [3])
    kv = reg.view("kv")
    assert "a" not in kv and len(kv) == 0 and kv.get("a") is None
    kv["a"] = "table-a"
    assert reg["a"].kv == "table-a" and "a" in kv and list(kv) == ["a"] and dict(kv.items()) == {"a": "table-a"}
    assert kv.pop("a") == "table-a" and reg["a"].kv is None and "a" in reg  # the part goes, the request stays
    with pytest.raises(KeyError):
        kv["nobody"] = "x"  # a part needs its request registered first
    with pytest.raises(KeyError):
        del kv["b"]


def test_token_ids_are_held_once():
    seq = Sequence("a", [5, 6, 7])
    seq.append_output([8, -1])
    seq.set_output(1, 9)
    assert seq.all_token_ids == [5, 6, 7, 8, 9] and seq.num_prompt_tokens == 3
    assert seq.prompt_token_ids == [5, 6, 7] and seq.output_token_ids == [8, 9] and seq.num_output_tokens == 2
    lists = [f.name for f in dataclasses.fields(Request) if f.type in ("list[int]",)]
    assert lists == ["all_token_ids", "spec_token_ids"]  # drafts are not tokens of the request yet


def test_core_scheduler_block_manager_and_batch_share_one_registry():
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    lm = load_model(resolve(str(TINY)), dtype="float32", device="cpu", load_format="dummy")
    llm = LLM.from_model(lm, kv_cache_gb=0.01, max_num_seqs=3)
    core = llm.engine
    bm, batch = core.scheduler.block_manager, core.runner.batch
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = [core.add_request([(7 * i + j) % 300 for j in range(5 + 20 * i)], params) for i in range(5)]
    seen_running = 0
    while core.has_work():
        core.step()
        for rid, req in core.requests.items():
            assert core.scheduler.get(rid) is req
            if bm.has_seq(rid):  # the block table is the request's own part, not a copy kept elsewhere
                assert bm.block_ids(rid) is req.kv.block_ids
            seen_running += req.batch_row is not None
        assert {s.seq_id for s in core.scheduler.running} <= set(core.requests)
        assert len(batch) == sum(1 for r in core.requests.values() if r.batch_row is not None)
    assert seen_running > 0 and not core.requests and len(batch) == 0 and core.stats().kv_blocks_used == 0
    assert len(ids) == core.num_requests_finished
