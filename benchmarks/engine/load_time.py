"""Model load time, this checkout vs a baseline git ref (default `main`), interleaved A/B in fresh processes.

    python benchmarks/engine/load_time.py [--baseline main] [--model smollm2-135m] [--rounds 5] [--profile]

Each round runs one fresh process per side, in alternating order; each process imports edgeserve first
(untimed), then times `GGUFFile(path)` and then the full `load_model(resolve(path))` (the server's first-request
load). The baseline is `git archive`d and pip-installed into a temporary folder, so nothing in the repository
changes. Prints per-round times, medians and new/baseline ratios as JSON. `--profile` also prints a cProfile
of one load on this checkout (top functions by cumulative time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, os, sys, time
if os.environ.get("LOAD_TIME_BASELINE"):
    # An editable install's import hook, or a checkout as the working directory, would win over PYTHONPATH
    # and load this checkout's modules.
    sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in type(f).__module__]
    sys.path[:] = [p for p in sys.path if p not in ("", os.getcwd())]
import torch
from edgeserve.loaders.gguf_file import GGUFFile
from edgeserve.models.load import load_model
from edgeserve.registry import resolve
src = resolve(sys.argv[1])
t = time.perf_counter()
GGUFFile(src.path)
parse_s = time.perf_counter() - t
t = time.perf_counter()
load_model(src)
load_s = time.perf_counter() - t
import edgeserve.loaders.gguf_file as module
print(json.dumps({"gguf_file_s": parse_s, "load_model_s": load_s, "code": module.__file__}))
"""

PROFILE = r"""
import cProfile, pstats, sys
from edgeserve.models.load import load_model
from edgeserve.registry import resolve
src = resolve(sys.argv[1])
load_model(src)  # warm the page cache and lazy imports
p = cProfile.Profile()
p.runcall(load_model, src)
pstats.Stats(p).sort_stats("cumulative").print_stats(25)
"""


def install_ref(ref: str, into: Path) -> Path:
    """`ref` of this repository, installed (no deps) into a folder to put first on PYTHONPATH."""
    src, site = into / "src", into / "site"
    src.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip, "--target", str(site), str(src)], check=True)
    return site


def measure(model: str, pythonpath: str | None) -> dict[str, float | str]:
    env = None if pythonpath is None else {**os.environ, "PYTHONPATH": pythonpath, "LOAD_TIME_BASELINE": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, model], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default="main", help="git ref to compare against")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base_site = str(install_ref(a.baseline, Path(tmp)))
        sides: dict[str, str | None] = {"baseline": base_site, "new": None}
        rows: dict[str, list[dict]] = {"baseline": [], "new": []}
        measure(a.model, None)  # warm the page cache (and pull the model if needed) before round 1
        for r in range(a.rounds):
            order = ["baseline", "new"] if r % 2 == 0 else ["new", "baseline"]
            for side in order:
                row = measure(a.model, sides[side])
                rows[side].append(row)
                print(json.dumps({"round": r + 1, "side": side, **row}), flush=True)
    # Each side really ran its own code.
    assert all(row["code"].startswith(base_site) for row in rows["baseline"])
    assert all(row["code"].startswith(str(REPO)) for row in rows["new"])
    summary: dict[str, object] = {"model": a.model, "baseline": a.baseline, "rounds": a.rounds}
    for key in ("gguf_file_s", "load_model_s"):
        med = {side: statistics.median(row[key] for row in rows[side]) for side in rows}
        summary[key] = {"baseline_median": round(med["baseline"], 3), "new_median": round(med["new"], 3),
                        "new_over_baseline": round(med["new"] / med["baseline"], 4)}  # fmt: skip
    print(json.dumps(summary))
    if a.profile:
        subprocess.run([sys.executable, "-c", PROFILE, a.model], check=True)


if __name__ == "__main__":
    main()
