"""Load time and peak RSS of loading a model, each load in a fresh process; medians over runs.

    python benchmarks/load_memory.py [--model smollm2-135m] [--runs 5] [--dtype auto]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
import torch
from edgeserve.models.load import load_model
from edgeserve.registry import resolve
src = resolve(sys.argv[1])
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
lm = load_model(src, dtype=sys.argv[2])
dt = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
import psutil
print(json.dumps({"load_s": dt, "peak_rss_mb": peak / 1024, "rss_before_load_mb": base / 1024,
                  "rss_after_load_mb": psutil.Process().memory_info().rss / 2**20,
                  "file_mb": src.path.stat().st_size / 1e6}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dtype", default="auto")
    a = ap.parse_args()
    rows = []
    for _ in range(a.runs):
        out = subprocess.run([sys.executable, "-c", CHILD, a.model, a.dtype], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(json.dumps({"model": a.model, "dtype": a.dtype, "runs": a.runs, **{k: round(v, 3) for k, v in med.items()}}))


if __name__ == "__main__":
    main()
