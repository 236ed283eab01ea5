"""Host time to build one step's flat inputs (token ids, positions, KV slots, query starts, lengths, block tables):
the persistent batch's `InputBatch.prepare` against the lists-then-tensors path the engine used before (re-written
here as it was: flatten each ScheduledSeq's lists, one `to_device` per input), side by side in one process.

Decode steps (one token per sequence, each with a 20-block table) at batch 1, 8 and 32; the two paths alternate
for `--rounds` rounds of `--number` calls; medians of the per-round means are printed.

    python benchmarks/engine/step_inputs.py [--rounds 7] [--number 2000]
"""

from __future__ import annotations

import argparse
import statistics
import timeit

import torch

from edgeserve.engine.runner.input_batch import InputBatch
from edgeserve.engine.sched.scheduler import ScheduledSeq
from edgeserve.kernels.transfer import to_device


def lists_path(batch: InputBatch, step: list[ScheduledSeq]) -> None:
    """The inputs as the engine built them before the step buffers: flat Python lists, then one tensor each."""
    rows = [batch.sync(s.seq_id, s.block_table) for s in step]
    batch.tables(rows, max(len(s.block_table) for s in step))
    query_lens = [s.num_new_tokens for s in step]
    to_device([t for s in step for t in s.token_ids], torch.long, "cpu")
    to_device([p for s in step for p in s.positions], torch.long, "cpu")
    to_device([x for s in step for x in s.slot_mapping], torch.long, "cpu")
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    to_device(starts, torch.int32, "cpu")
    to_device([s.context_len for s in step], torch.int32, "cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--number", type=int, default=2000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'batch':>5} {'lists (before)':>15} {'prepare':>10}  ratio")
    for b in (1, 8, 32):
        step = [ScheduledSeq(i, [5 + i], [300 + i], [4800 + i], list(range(i, i + 20)), 301 + i, True) for i in range(b)]
        batch = InputBatch(64, 64, "cpu", 512)
        times: dict[str, list[float]] = {"lists": [], "prepare": []}
        for _ in range(args.rounds):
            times["lists"].append(timeit.timeit(lambda: lists_path(batch, step), number=args.number) / args.number)
            times["prepare"].append(timeit.timeit(lambda: batch.prepare(step), number=args.number) / args.number)
        old, new = (statistics.median(times[k]) * 1e6 for k in ("lists", "prepare"))
        print(f"{b:>5} {old:>12.1f} us {new:>7.1f} us  {new / old:.2f}")


if __name__ == "__main__":
    main()
