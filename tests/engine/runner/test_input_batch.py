"""The persistent input batch: block-table rows written in place (only new blocks), shrunk on rollback, freed when a
sequence leaves; the engine keeps exactly its running sequences there and builds no table from Python lists."""

from __future__ import annotations

from pathlib import Path

from edgeserve.engine.runner import input_batch
from edgeserve.engine.runner.input_batch import InputBatch
from edgeserve.llm import LLM
from edgeserve.sampling_params import SamplingParams

TINY = Path(__file__).resolve().parents[3] / "benchmarks" / "configs" / "tiny-llama.json"


def test_rows_write_only_new_blocks_and_follow_shrink_and_remove(monkeypatch):
    writes = []
    original = input_batch.to_device
    monkeypatch.setattr(input_batch, "to_device", lambda v, *a: (writes.append(len(v)), original(v, *a))[1])
    batch = InputBatch(2, 8, "cpu")
    table = [5, 3]
    row = batch.sync("a", table)
    assert batch.sync("a", table) == row and writes == [2]  # nothing new: nothing written
    table.append(7)
    batch.sync("a", table)
    assert writes == [2, 1] and batch.tables([row], 3).tolist() == [[5, 3, 7]]
    table[1:] = [4]  # rollback to one block, then a different block appended
    batch.shrink("a", 1)
    batch.sync("a", table)
    assert batch.tables([row], 2).tolist() == [[5, 4]]
    other = batch.sync("b", [1])
    assert other != row and batch.tables([other, row], 2)[:, :1].tolist() == [[1], [5]]
    batch.remove("a")
    batch.sync("c", [9, 9, 9])  # takes the freed row; a third sequence would grow the tensor
    batch.sync("d", [2])
    assert len(batch) == 3 and batch.block_tables.shape[0] == 4
    assert batch.tables([0, 1], 4).data_ptr() == batch.block_tables.data_ptr()  # rows 0..B-1: a view, no copy


def test_engine_keeps_only_running_sequences_and_copies_no_table(monkeypatch):
    from edgeserve.engine.cache.kv_blocks import BlockManager
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    copies = []
    original = BlockManager.block_table
    monkeypatch.setattr(BlockManager, "block_table", lambda self, seq: (copies.append(seq), original(self, seq))[1])
    lm = load_model(resolve(str(TINY)), dtype="float32", device="cpu", load_format="dummy")
    prompts = [[(11 * i + 7 * j) % 300 for j in range(3 + 17 * i)] for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm = LLM.from_model(lm, kv_cache_gb=0.01, max_num_seqs=4)
    core = llm.engine
    for p in prompts:
        core.add_request(p, params)
    while core.has_work():
        core.step()
        assert len(core.runner.batch) == len(core.scheduler.running)
    assert not copies  # block tables are read live and written in place, never copied per step
    alone = [LLM.from_model(lm, kv_cache_gb=0.01).generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert [r.outputs[0].token_ids for r in llm.generate(prompts, params)] == alone
    assert len(core.runner.batch) == 0


def test_step_inputs_are_written_in_place_into_the_batch_buffers():
    """A mixed step (a decode beside prefill chunks) and a step of decodes get the scheduler's ids, positions and
    slots, written into the batch's preallocated buffers (views of them on CPU: nothing allocated per step for
    them), two in turn."""
    from edgeserve.engine.sched.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, Sequence

    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12, block_size=4), 32)
    sched.add(Sequence("a", [1, 2, 3]))
    first = sched.schedule()
    sched.update(first, {"a": [40]})
    sched.add(Sequence("b", list(range(100, 109))))
    sched.add(Sequence("c", [7, 8]))
    step = sched.schedule().scheduled
    assert [s.num_new_tokens for s in step] != [1] * len(step)  # a decode and prefill chunks together
    decodes = [ScheduledSeq(sid, [t], [p], [7 * p], [1, 2], p + 1, True) for sid, t, p in [("x", 5, 30), ("y", 6, 17)]]
    batch = InputBatch(4, 8, "cpu", max_num_tokens=16)
    buffers = [b.i64 for b in batch._host]
    for step in [step, decodes, step, decodes, step]:
        inputs = batch.prepare(step)
        assert inputs.token_ids.tolist() == [t for s in step for t in s.token_ids]
        assert inputs.positions.tolist() == [p for s in step for p in s.positions]
        assert inputs.slot_mapping.tolist() == [x for s in step for x in s.slot_mapping]
        assert inputs.seq_lens.tolist() == [s.context_len for s in step]
        starts = [0]
        for s in step:
            starts.append(starts[-1] + s.num_new_tokens)
        assert inputs.query_start_loc.tolist() == starts
        base = inputs.token_ids.untyped_storage().data_ptr()
        assert any(base == t.untyped_storage().data_ptr() for t in buffers)
