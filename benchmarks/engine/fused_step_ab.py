"""The model part of a fused CPU decode step (forward + logits), this checkout's native library against another
build's (`--baseline-lib`, e.g. main's), side by side in one process.

Loads the model once per library (each side's weights repacked and planned by its own library), fills a paged pool
for B sequences of `--context` tokens, then times blocks of decode steps, the sides taking turns (A B B A ...) with
a pause between blocks so that the idle side's pool workers are asleep. Prints per side the median step (ms) and
the ratio, as JSON. `--single-thread` runs one thread and reads thread CPU time (steadier on a busy machine).

    python benchmarks/engine/fused_step_ab.py --baseline-lib OLD.so [--model smollm2-135m | GGUF] [--batch 1,8]
        [--context 128] [--blocks 12] [--steps 5] [--single-thread] [--lib OTHER.so]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time


def _parse_args() -> argparse.Namespace:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-lib", required=True)
    ap.add_argument("--lib", help="the library of the 'this checkout' side (default: this checkout's build)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=12, help="timed blocks per side and batch")
    ap.add_argument("--steps", type=int, default=5, help="steps per block (the first one is not timed)")
    ap.add_argument("--single-thread", action="store_true")
    return ap.parse_args()


def _load_sides(args: argparse.Namespace) -> tuple[tuple[str, str], dict, dict]:
    """(the native setting key, {side: library}, {side: the model loaded and planned by that library})."""
    from edgeserve import LLM
    from edgeserve.kernels.cpu import native as cpu_native

    setting = (os.environ.get("EDGESERVE_NATIVE", "1"), os.environ.get("EDGESERVE_NATIVE_VARIANT", ""))
    libs = {"baseline": cpu_native._bind(ctypes.CDLL(args.baseline_lib)), "this checkout": cpu_native._bind(ctypes.CDLL(args.lib)) if args.lib else cpu_native.library()}
    models = {}
    for name, lib in libs.items():
        cpu_native._chosen[setting] = lib
        model = LLM(args.model, kv_cache_gb=0.05).lm.model
        assert model.native_decoder() is not None and model.native_decoder().lib is lib
        models[name] = model
    return setting, libs, models


def main() -> None:
    args = _parse_args()

    from edgeserve.bench.cpu_clock import cpu_clock

    clock = cpu_clock(args.single_thread)

    import torch

    from edgeserve.engine.kv_cache import KVPool, PagedKVAttention
    from edgeserve.kernels.cpu import native as cpu_native
    from edgeserve.kernels.torch.paged_attention import AttentionMetadata
    from profile_fused_step import hybrid_states

    setting, libs, models = _load_sides(args)
    block = 16
    per_seq = -(-(args.context + 1) // block)
    result: dict = {"model": args.model, "context": args.context, "single_thread": args.single_thread,
                    "threads": cpu_native.threads(), "batches": {}}
    for b in (int(x) for x in args.batch.split(",")):
        tables = [[i * per_seq + j for j in range(per_seq)] for i in range(b)]
        ids = torch.randint(100, 1000, (b * args.context,))
        pos = torch.arange(args.context).repeat(b)
        slots = [tables[i][p // block] * block + p % block for i in range(b) for p in range(args.context)]
        p = args.context
        step_slots = [tables[i][p // block] * block + p % block for i in range(b)]
        step_ids, step_pos = torch.randint(100, 1000, (b,)), torch.full((b,), p)
        steps = {}
        for name, model in models.items():
            cpu_native._chosen[setting] = libs[name]
            pool = KVPool(model.config, b * per_seq, block, model.dtype)
            states = hybrid_states(model.config, b)  # a hybrid's recurrent states (None for others)
            model.forward(ids, pos, PagedKVAttention(pool, AttentionMetadata.build([p] * b, [p] * b, tables, slots),
                                                     states=states(p)))

            def step(model=model, pool=pool, states=states) -> torch.Tensor:
                meta = AttentionMetadata.build([1] * b, [p + 1] * b, tables, step_slots)
                return model.logits(model.forward(step_ids, step_pos, PagedKVAttention(pool, meta, states=states(1))))
            steps[name] = step
        outs = {name: fn() for name, fn in steps.items()}
        same = torch.equal(*outs.values())
        times: dict[str, list[float]] = {name: [] for name in steps}
        order = list(steps)
        for blk in range(args.blocks):
            for name in (order if blk % 2 == 0 else order[::-1]):
                cpu_native._chosen[setting] = libs[name]
                time.sleep(0.05)  # the other side's pool workers go to sleep
                steps[name]()
                for _ in range(args.steps - 1):
                    t = clock()
                    steps[name]()
                    times[name].append((clock() - t) * 1e3)
        med = {name: statistics.median(v) for name, v in times.items()}
        result["batches"][b] = {"median_ms": {k: round(v, 3) for k, v in med.items()},
                                "speedup": round(med["baseline"] / med["this checkout"], 3),
                                "same_logits": same}
        print(json.dumps({b: result["batches"][b]}), flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
