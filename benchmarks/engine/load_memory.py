"""Load time and peak RSS of loading a model, each load in a fresh process; medians over runs.

    python benchmarks/engine/load_memory.py [--model smollm2-135m] [--runs 5] [--dtype auto] [--llama-server PATH]

With --llama-server, each run also starts llama.cpp's server on the same GGUF (1 slot, 4,096 context, 2 threads)
and times it from spawn until /health answers 200 (it loads the model before that), with its resident memory
then; the two sides alternate who goes first. Our side is timed two ways: `load_model` alone (after the imports),
and the whole process from spawn to loaded (Python, torch and edgeserve imports included).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

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
    ap.add_argument("--llama-server", default=None, metavar="PATH", help="also time llama.cpp's server on the GGUF")
    a = ap.parse_args()
    rows = []

    def ours() -> dict:
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", CHILD, a.model, a.dtype], capture_output=True, text=True, check=True)
        return {**json.loads(out.stdout.strip().splitlines()[-1]), "spawn_to_loaded_s": time.perf_counter() - t}

    for i in range(a.runs):
        row = {}
        for side in (["ours", "llama"] if i % 2 == 0 else ["llama", "ours"]) if a.llama_server else ["ours"]:
            row.update(ours() if side == "ours" else llama_server_load(a.llama_server, a.model))
        rows.append(row)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    if a.llama_server:
        med["ratio_load_model_vs_llama_ready"] = med["load_s"] / med["llama_spawn_to_ready_s"]
        med["ratio_spawn_to_loaded_vs_llama_ready"] = med["spawn_to_loaded_s"] / med["llama_spawn_to_ready_s"]
    print(json.dumps({"model": a.model, "dtype": a.dtype, "runs": a.runs, **{k: round(v, 3) for k, v in med.items()}}))


def llama_server_load(binary: str, model: str) -> dict:
    """Seconds from spawning llama-server on `model`'s GGUF until /health is 200, and its RSS then (MB)."""
    import psutil

    from edgeserve.bench.compare import llama_server_command
    from edgeserve.bench.servers import free_port, start_server, stop_server
    from edgeserve.registry import resolve

    port = free_port()
    t = time.perf_counter()
    server = start_server("llama-server", llama_server_command(binary, str(resolve(model).path), port, 1, 4096, 2),
                          port, "/health")
    try:
        ready = time.perf_counter() - t
        return {"llama_spawn_to_ready_s": ready, "llama_rss_mb": psutil.Process(server.pid).memory_info().rss / 2**20}
    finally:
        stop_server(server)


if __name__ == "__main__":
    main()
