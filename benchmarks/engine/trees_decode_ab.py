"""Decode steps of one GGUF model in two source trees (e.g. a worktree at the commit before a change, and this
one), alternating processes: each round runs a worker per tree (order rotating) that loads the model at dtype auto,
fills a paged pool with B sequences of `--context` tokens, and times `--steps` decode steps (forward + logits,
the first untimed) at batch B on whatever path the model takes (the fused native stack where it applies). Prints
each tree's median step time (ms) over all rounds and the ratio, as JSON.

    python benchmarks/engine/trees_decode_ab.py -m MODEL.gguf --python /tmp/before/.venv/bin/python,.venv/bin/python \\
        [--batch 1] [--context 64] [--steps 12] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def worker(model_path: str, batch: int, context: int, steps: int) -> list[float]:
    """Decode-step times (ms) of this interpreter's edgeserve tree."""
    import torch

    from edgeserve.engine.kv_cache import KVPool, PagedKVAttention
    try:  # kernels by backend (after 2026-12-02); older trees keep the flat kernels/
        from edgeserve.kernels.torch.paged_attention import AttentionMetadata
    except ImportError:
        from edgeserve.kernels.paged_attention import AttentionMetadata
    from edgeserve.models.encoder_threads import intra_op_threads
    from edgeserve.models.load import load_model
    from edgeserve.registry.resolve import resolve

    model = load_model(resolve(model_path, pull_missing=False), dtype="auto").model
    block, b, p = 16, batch, context
    per_seq = -(-(p + steps + 1) // block)
    tables = [[i * per_seq + j for j in range(per_seq)] for i in range(b)]
    pool = KVPool(model.config, b * per_seq, block, model.dtype)
    ids, pos = torch.randint(100, 1000, (b * p,)), torch.arange(p).repeat(b)
    slots = [tables[i][q // block] * block + q % block for i in range(b) for q in range(p)]
    model.forward(ids, pos, PagedKVAttention(pool, AttentionMetadata.build([p] * b, [p] * b, tables, slots)))
    times = []
    with intra_op_threads(1):
        for s in range(steps):
            n = p + s
            meta = AttentionMetadata.build([1] * b, [n + 1] * b, tables,
                                           [tables[i][n // block] * block + n % block for i in range(b)])
            t = time.perf_counter()
            model.logits(model.forward(torch.randint(100, 1000, (b,)), torch.full((b,), n),
                                       PagedKVAttention(pool, meta)))
            if s:
                times.append((time.perf_counter() - t) * 1e3)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--python", help="the two trees' interpreters, comma-separated (A,B)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--worker", action="store_true")
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.model, a.batch, a.context, a.steps)))
        return
    pythons = a.python.split(",")
    times: dict[str, list[float]] = {py: [] for py in pythons}
    for r in range(a.rounds):
        for py in (pythons if r % 2 == 0 else pythons[::-1]):
            out = subprocess.run([py, __file__, "--worker", "-m", a.model, "--batch", str(a.batch), "--context",
                                  str(a.context), "--steps", str(a.steps)], capture_output=True, text=True, check=True)
            times[py] += json.loads(out.stdout.strip().splitlines()[-1])
    med = {py: statistics.median(v) for py, v in times.items()}
    print(json.dumps({"model": a.model, "batch": a.batch, "context": a.context, "steps_per_tree": len(times[pythons[0]]),
                      "median_ms": {py: round(v, 2) for py, v in med.items()},
                      "ratio_B_over_A": round(med[pythons[1]] / med[pythons[0]], 3)}))


if __name__ == "__main__":
    sys.exit(main())
