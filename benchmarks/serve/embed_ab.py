"""Embedding / rerank latency over HTTP, this tree's edgeserve against another checkout's (main's code), both servers
up at once and requests alternated per round: ms medians and the new/base time ratio per workload.

    git archive <base-commit> | tar -x -C /tmp/base   # then link its kernels/loaders/offload into its package:
    for d in kernels loaders offload; do ln -s ../$d /tmp/base/edgeserve/$d; done
    python benchmarks/serve/embed_ab.py --base-tree /tmp/base --model minilm-q8_0.gguf 64x1 512x1 64x32
    python benchmarks/serve/embed_ab.py --base-tree /tmp/base --model rerank-minilm-q8_0.gguf --rerank 64x1 64x32

Workloads are TOKENSxBATCH: one request carrying BATCH inputs of about TOKENS tokens (for --rerank, a 6-word
query and BATCH documents, each pair TOKENS tokens), the texts of embed_compare.py. The base server runs from
--base-tree (its directory first on the module path); the GGUFs come from embed_compare.py (--convert-folder,
--make-bert).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from edgeserve.bench.servers import start_edgeserve, stop_server

sys.path.insert(0, str(Path(__file__).parent))
from embed_compare import request, texts  # noqa: E402


def start_both(model: str, base_tree: str) -> dict:
    """The base server (run from `base_tree`) and this tree's, both on `model`."""
    here = os.getcwd()
    try:
        os.chdir(base_tree)  # `python -m edgeserve` imports the package from the working directory first
        base = start_edgeserve(model, max_seqs=32, env=dict(os.environ, PYTHONPATH=base_tree))
    finally:
        os.chdir(here)
    try:
        return {"base": base, "new": start_edgeserve(model, max_seqs=32)}
    except BaseException:
        stop_server(base)
        raise


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-tree", required=True, help="a checkout of the code to compare against (see above)")
    p.add_argument("--model", required=True, help="the GGUF both servers load")
    p.add_argument("--rerank", action="store_true", help="POST /v1/rerank (a rank-pooling GGUF)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--json", help="write the results here")
    p.add_argument("workloads", nargs="+", help="TOKENSxBATCH, e.g. 64x1 512x1 64x32")
    args = p.parse_args()
    if not (Path(args.base_tree) / "edgeserve" / "__init__.py").is_file():
        p.error(f"--base-tree {args.base_tree} holds no edgeserve package")
    servers = start_both(args.model, str(Path(args.base_tree).resolve()))
    name, results = Path(args.model).stem, {}
    try:
        for spec in args.workloads:
            n_tok, batch = map(int, spec.split("x"))
            inputs = texts(8, 1) + texts(n_tok - 8, batch) if args.rerank else texts(n_tok, batch)
            times: dict[str, list[float]] = {k: [] for k in servers}
            for srv in servers.values():
                request(srv.url, name, args.rerank, inputs)  # warm-up
            for r in range(args.rounds):
                for k in (("base", "new") if r % 2 == 0 else ("new", "base")):
                    times[k].append(request(servers[k].url, name, args.rerank, inputs))
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            results[spec] = {"base_ms": round(med["base"], 2), "new_ms": round(med["new"], 2),
                             "new_over_base_time": round(med["new"] / med["base"], 3), "rounds": args.rounds}
            print(f"{'rerank' if args.rerank else 'embed'} {spec:>7}: base {med['base']:9.2f} ms  new "
                  f"{med['new']:9.2f} ms  new/base time {med['new'] / med['base']:.3f}", flush=True)
    finally:
        for srv in servers.values():
            stop_server(srv)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "rerank": args.rerank, **results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
