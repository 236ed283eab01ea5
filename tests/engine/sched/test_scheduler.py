"""Scheduler: decodes first, token budget, chunked prefill, admission, preemption by recompute, abort."""

import random

import pytest
from support.scheduler_runs import run_scheduler

from edgeserve.engine.sched.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, Sequence, SeqStatus
from edgeserve.errors import EdgeserveError, QueueFullError


class FakeModel:
    """Writes fed tokens into a fake KV pool by slot; samples a hash of the context read back via block tables.

    So a wrong slot mapping, block table or prefix-cache hit changes the output.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.kv: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)

    def step(self, out: SchedulerOutput) -> dict:
        sampled = {}
        for s in out.scheduled:
            assert len(s.token_ids) == len(s.positions) == len(s.slot_mapping)
            for tok, pos, slot in zip(s.token_ids, s.positions, s.slot_mapping):
                self.kv[slot] = (pos, tok)
            if s.samples:
                ctx = [self.kv[s.block_table[p // self.bs] * self.bs + p % self.bs] for p in range(s.context_len)]
                assert [c[0] for c in ctx] == list(range(s.context_len))
                sampled[s.seq_id] = [hash(tuple(c[1] for c in ctx)) % 1000]
        return sampled


def run(sched: Scheduler, requests: dict, max_tokens: dict, arrivals: dict | None = None) -> dict:
    """Drive `sched` with FakeModel until every request is done; check invariants each step."""
    cfg, bm = sched.config, sched.block_manager

    def within_limits(out: SchedulerOutput) -> None:
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len(out.scheduled) <= cfg.max_num_seqs and len(sched.running) <= cfg.max_num_seqs
        assert len({s.seq_id for s in out.scheduled}) == len(out.scheduled)
        assert not out.finished
    done = run_scheduler(sched, FakeModel(bm.num_blocks, bm.block_size), requests, max_tokens, arrivals,
                         on_schedule=within_limits)
    assert bm.num_free_blocks == bm.num_blocks
    return done


def make_sched(num_blocks=64, **kw) -> Scheduler:
    cfg = dict(max_num_seqs=8, max_num_batched_tokens=32, max_waiting=64, block_size=4)
    cfg.update(kw)
    return Scheduler(SchedulerConfig(**cfg), num_blocks)


def step(sched: Scheduler, model: FakeModel) -> SchedulerOutput:
    out = sched.schedule()
    sched.update(out, model.step(out))
    return out


def test_decodes_come_before_prefill_chunks():
    sched = make_sched(max_num_batched_tokens=8)
    model = FakeModel(64, 4)
    sched.add(Sequence("a", [1, 2, 3]))
    out = step(sched, model)
    assert [(s.seq_id, s.num_new_tokens, s.samples) for s in out.scheduled] == [("a", 3, True)]
    sched.add(Sequence("b", list(range(20))))
    out = step(sched, model)
    assert [(s.seq_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 7)]
    assert out.scheduled[0].positions == [3] and out.scheduled[1].positions == list(range(7))
    out = step(sched, model)
    assert [(s.seq_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 7)]
    assert out.positions == [4] + list(range(7, 14))
    assert out.context_lens == [5, 14]


def test_long_prompt_is_chunked_and_completes():
    sched = make_sched(max_num_batched_tokens=16)
    model = FakeModel(64, 4)
    sched.add(Sequence("long", list(range(50))))
    chunks = []
    for _ in range(4):
        out = step(sched, model)
        (s,) = out.scheduled
        chunks.append((s.num_new_tokens, s.samples, len(sched.get("long").output_token_ids)))
    assert chunks == [(16, False, 0), (16, False, 0), (16, False, 0), (2, True, 1)]
    assert sched.get("long").num_computed_tokens == 50
    out = step(sched, model)
    assert out.scheduled[0].positions == [50]


def test_prefix_hit_sets_num_computed_tokens():
    sched = make_sched()
    shared = list(range(100, 112))
    run(sched, {"a": shared + [1, 2]}, {"a": 3})
    sched.add(Sequence("b", shared + [7, 8, 9]))
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.positions[0] == 12 and s.token_ids == [7, 8, 9]
    assert sched.block_manager.num_prompt_tokens_reused == 12


def test_max_num_seqs_and_fcfs_admission():
    sched = make_sched(max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(4):
        sched.add(Sequence(i, [i] * 5))
    out = sched.schedule()
    assert [s.seq_id for s in out.scheduled] == [0, 1]
    assert [s.seq_id for s in sched.waiting] == [2, 3]


def test_queue_full_raises_busy():
    sched = make_sched(max_waiting=2)
    sched.add(Sequence("a", [1]))
    sched.add(Sequence("b", [1]))
    with pytest.raises(QueueFullError) as e:
        sched.add(Sequence("c", [1]))
    assert isinstance(e.value, EdgeserveError) and str(e.value) == "busy"


def test_prompt_larger_than_pool_is_rejected():
    with pytest.raises(ValueError):
        make_sched(num_blocks=2).add(Sequence("a", list(range(9))))


def test_preempts_newest_and_requeues_it_first():
    sched = make_sched(num_blocks=4, block_size=2, max_num_batched_tokens=100)
    model = FakeModel(4, 2)
    for sid in "abc":
        sched.add(Sequence(sid, [1, 2, 3]))
    out = step(sched, model)  # a and b take all 4 blocks; c waits
    assert [s.seq_id for s in out.scheduled] == ["a", "b"]
    step(sched, model)  # both decode into their second block
    out = step(sched, model)  # a needs a third block: b (newest) is preempted
    assert out.preempted == ["b"] and [s.seq_id for s in out.scheduled] == ["a"]
    b = sched.get("b")
    assert b.status is SeqStatus.WAITING and b.num_computed_tokens == 0 and len(b.output_token_ids) == 2
    assert [s.seq_id for s in sched.waiting] == ["b", "c"]
    sched.block_manager.check_integrity()


def test_sequence_outgrowing_pool_is_finished_not_hung():
    sched = make_sched(num_blocks=2, block_size=2)
    model = FakeModel(2, 2)
    sched.add(Sequence("a", [1, 2, 3]))
    for _ in range(2):
        out = step(sched, model)
    out = sched.schedule()
    assert out.finished == ["a"] and not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 2


def test_abort_frees_blocks_immediately():
    sched = make_sched(num_blocks=16)
    sched.add(Sequence("a", list(range(10))))
    sched.add(Sequence("b", list(range(30))))
    out = sched.schedule()
    assert sched.block_manager.num_free_blocks < 16
    sched.abort("a")
    sched.abort("b")
    assert sched.block_manager.num_free_blocks == 16 and not sched.running
    sched.update(out, {"a": [1]})  # a step that was in flight is ignored
    sched.block_manager.check_integrity()
    sched.add(Sequence("c", [5]))
    assert sched.abort("c").finish_reason == "abort" and not sched.waiting


def _workload(seed: int, n: int = 10):
    rng = random.Random(seed)
    system = [rng.randrange(50) for _ in range(9)]
    requests, max_tokens, arrivals = {}, {}, {}
    for i in range(n):
        own = [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
        requests[i] = (system if rng.random() < 0.6 else []) + own
        max_tokens[i] = rng.randrange(1, 20)
        arrivals[i] = rng.randrange(0, 15)
    return requests, max_tokens, arrivals


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_preemption_run_matches_unconstrained_run(seed):
    requests, max_tokens, arrivals = _workload(seed)
    reference = run(make_sched(num_blocks=200, max_num_batched_tokens=512), requests, max_tokens, arrivals)
    tight = make_sched(num_blocks=11, max_num_batched_tokens=12)  # 44 slots: each request fits alone
    assert run(tight, requests, max_tokens, arrivals) == reference
    assert tight.num_preemptions > 0
    assert tight.block_manager.num_prompt_tokens_reused > 0
