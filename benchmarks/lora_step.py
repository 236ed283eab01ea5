"""One fused decode step of the default model in one process: 8 rows on the base alone vs 8 rows over 4 different
rank-16 LoRA adapters (bfloat16, as the engine keeps them beside a bfloat16 model), alternating, medians of
--reps; the step-level cost of the adapters without the server around it.

    python benchmarks/lora_step.py [--targets all|q_proj,v_proj] [--rows 8] [--adapters 4]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from edgeserve.bench.random_lora import PROJECTIONS, random_pairs, write_peft
from edgeserve.engine.kv_cache import KVPool, PagedKVAttention
from edgeserve.kernels.paged_attention import AttentionMetadata
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

    def step_ms(mixed: bool, n: int = 10) -> float:
        start = time.perf_counter()
        for _ in range(n):
            lora = StepLora.build([(adapters[i % len(adapters)], 1.0) for i in range(t)], [1] * t) if mixed else None
            model.forward(ids, pos, PagedKVAttention(pool, meta), lora=lora)
        return (time.perf_counter() - start) / n * 1000

    step_ms(False, 2), step_ms(True, 2)
    base, mixed = [], []
    for _ in range(args.reps):
        base.append(step_ms(False))
        mixed.append(step_ms(True))
    b, m = statistics.median(base), statistics.median(mixed)
    print(f"{t} decode rows, {args.adapters} rank-{args.rank} adapters on {','.join(targets)}: base {b:.2f} ms, "
          f"mixed {m:.2f} ms per step; throughput mixed/base {b / m:.2f}x "
          f"(base {', '.join(f'{x:.1f}' for x in base)}; mixed {', '.join(f'{x:.1f}' for x in mixed)})")


if __name__ == "__main__":
    main()
