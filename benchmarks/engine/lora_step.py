"""One fused decode step of the default model in one process: 8 rows on the base alone vs 8 rows over 4 different
rank-16 LoRA adapters, read as bfloat16 (as the engine keeps them beside a bfloat16 model) and as the int8 copy
(--lora-weights int8, the default beside this quantized base), alternating, medians of --reps; the step-level cost
of the adapters without the server around it.

    python benchmarks/engine/lora_step.py [--targets all|q_proj,v_proj] [--rows 8] [--adapters 4] [--cpu-time]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from edgeserve.bench.random_lora import PROJECTIONS, random_pairs, write_peft
from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention
from edgeserve.kernels.torch.paged_attention import AttentionMetadata
from edgeserve.models.load import load_model
from edgeserve.models.lora import load_adapter
from edgeserve.models.lora_step import StepLora
from edgeserve.registry import DEFAULT_MODEL, resolve


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", default="all")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--context", type=int, default=100, help="tokens each row attends to")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--cpu-time", action="store_true", help="the process's CPU time per step rather than wall time "
                   "(steadier on a busy machine; counts both threads' work)")
    args = p.parse_args()
    lm = load_model(resolve(DEFAULT_MODEL), dtype="bfloat16")
    model, config = lm.model, lm.config
    targets = PROJECTIONS if args.targets == "all" else tuple(args.targets.split(","))
    tmp = Path(tempfile.mkdtemp(prefix="lora-step-"))
    adapters = [load_adapter(f"a{i}", write_peft(tmp / f"a{i}", random_pairs(config, args.rank, i, targets, std=0.04),
                                                 args.rank, 2.0 * args.rank), config).to("cpu", torch.bfloat16)
                for i in range(args.adapters)]
    t, bs = args.rows, 16
    per = -(-(args.context + 1) // bs)
    pool = KVPool(config, t * per, bs, model.dtype)
    meta = AttentionMetadata.build([1] * t, [args.context] * t, [[per * i + j for j in range(per)] for i in range(t)],
                                   [per * i * bs + args.context - 1 for i in range(t)])
    ids, pos = torch.arange(10, 10 + t), torch.full((t,), args.context - 1)

    tables: dict = {}
    clock = time.process_time if args.cpu_time else time.perf_counter

    def step_ms(mode: str, n: int = 10) -> float:
        for a in adapters:  # each kind's native table built once and kept
            tables.setdefault((id(a), a.int8), a.native)
            a.int8 = mode == "int8"
            a.native = tables.get((id(a), a.int8))
        start = clock()
        for _ in range(n):
            lora = (StepLora.build([(adapters[i % len(adapters)], 1.0) for i in range(t)], [1] * t)
                    if mode != "base" else None)
            model.forward(ids, pos, PagedKVAttention(pool, meta), lora=lora)
        return (clock() - start) / n * 1000

    modes = ("base", "bf16", "int8")
    for mode in modes:
        step_ms(mode, 2)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.reps):
        for mode in modes:
            times[mode].append(step_ms(mode))
    med = {m: statistics.median(v) for m, v in times.items()}
    print(f"{t} decode rows, {args.adapters} rank-{args.rank} adapters on {','.join(targets)}, "
          f"{'CPU' if args.cpu_time else 'wall'} ms per step (medians of {args.reps}):")
    for mode in modes:
        print(f"  {mode:5s} {med[mode]:6.2f} ms  throughput vs base {med['base'] / med[mode]:.2f}x  "
              f"({', '.join(f'{x:.1f}' for x in times[mode])})")


if __name__ == "__main__":
    main()
