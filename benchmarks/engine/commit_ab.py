"""Decode speed of two commits side by side in one invocation (issue 48's "speed unchanged" check).

Each commit is checked out into a temporary git worktree (edgeserve.bench.checkout); one worker process per side
imports that worktree only (PYTHONPATH), so each side builds and loads its own native library from its own
kernels/cpu sources (cached by source hash). Both workers load the same model once; then decode runs alternate
between the sides (old/new, new/old, ...) for `--rounds` rounds. One run: B copies of a chat prompt generate 1 and
then `--tokens` tokens, greedy; step time = (time to N tokens - time to 1 token) / (N - 1), so prefill is excluded.
Prints per side the median step (ms), the ratio new/old (below 1.0: new is faster), whether both sides generated
the same ids, and the library each side loaded, as JSON on the last line.

    python benchmarks/engine/commit_ab.py --old 9e71e6a --new HEAD [--model smollm2-135m | GGUF] [--rounds 8]
        [--tokens 32] [--batch 1] [--threads 1]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "Write a long story about a lighthouse keeper and a storm."
REPO = Path(__file__).resolve().parents[2]


def worker(model: str, tokens: int, batch: int) -> None:
    """One side: load `model` with the importable edgeserve, then answer each stdin line with one decode run's
    JSON ({"step_ms", "digest"}); the first line out says which files were imported and which library loaded."""
    import edgeserve
    import edgeserve.kernels
    from edgeserve import LLM, SamplingParams
    try:  # kernels by backend (after 2026-12-02); older commits keep the flat kernels/
        from edgeserve.kernels.cpu import native as cpu_native
    except ImportError:
        from edgeserve.kernels import cpu_native

    llm = LLM(model, kv_cache_gb=0.25, enable_prefix_caching=False)
    ids = llm.lm.tokenizer.encode(llm.lm.chat_template.render([{"role": "user", "content": PROMPT}],
                                                               add_generation_prompt=True), add_special_tokens=False)

    def run(n: int) -> tuple[float, list]:
        start = time.perf_counter()
        out = llm.generate([ids] * batch, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - start, [o.outputs[0].token_ids for o in out]

    run(4)  # warm-up
    lib = cpu_native.library()
    print(json.dumps({"edgeserve": [edgeserve.__file__, edgeserve.kernels.__file__],
                      "library": getattr(lib, "_name", None), "threads": cpu_native.threads()}), flush=True)
    for _ in sys.stdin:
        t1, _ = run(1)
        tn, outs = run(tokens)
        print(json.dumps({"step_ms": (tn - t1) / (tokens - 1) * 1e3,
                          "digest": hashlib.sha256(json.dumps(outs).encode()).hexdigest()[:16]}), flush=True)


class Side:
    """A worker process over one commit's worktree."""

    def __init__(self, tree: Path, args: argparse.Namespace) -> None:
        env = dict(os.environ, PYTHONPATH=str(tree))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", args.model,
               "--tokens", str(args.tokens), "--batch", str(args.batch)]
        self.proc = subprocess.Popen(cmd, env=env, cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with {self.proc.wait()}")
        return json.loads(line)

    def run(self) -> dict:
        """One decode run's JSON."""
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def compare(sides: dict[str, Side], rounds: int) -> dict:
    """Alternate one run per side per round (the order reversed every other round); medians, ratio, digests."""
    from edgeserve.bench.timing import Alternation

    times = Alternation({name: [] for name in sides})
    digests: dict[str, set[str]] = {name: set() for name in sides}
    names = list(sides)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            out = sides[name].run()
            times.times[name].append(out["step_ms"] / 1e3)
            digests[name].add(out["digest"])
            print(f"round {r + 1} {name}: {out['step_ms']:.2f} ms/step", flush=True)
    old, new = names
    return {"median_step_ms": {n: round(times.median_ms(n), 3) for n in names},
            "min_step_ms": {n: round(times.min_ms(n), 3) for n in names},
            "ratio_new_over_old": round(times.ratio(new, old), 3), "same_ids": digests[old] == digests[new]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", help="git revision of the baseline side")
    ap.add_argument("--new", default="HEAD", help="git revision of the other side (default HEAD)")
    ap.add_argument("--model", default="smollm2-135m", help="model name or GGUF path")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.model, args.tokens, args.batch)
        return
    if not args.old:
        ap.error("--old REV is required")
    from edgeserve.bench.checkout import remove_worktree, short_commit, worktree

    revs = {"old": short_commit(args.old, REPO), "new": short_commit(args.new, REPO)}
    trees = {name: worktree(rev, REPO) for name, rev in revs.items()}
    sides: dict[str, Side] = {}
    try:
        for name, tree in trees.items():  # one at a time: each may build its library first
            sides[name] = Side(tree, args)
            print(f"{name} {revs[name]}: {sides[name].info}", flush=True)
        result = compare(sides, args.rounds)
    finally:
        for side in sides.values():
            side.close()
        for tree in trees.values():
            remove_worktree(tree, REPO)
    result.update(commits=revs, model=args.model, batch=args.batch, tokens=args.tokens, rounds=args.rounds,
                  sides={n: s.info for n, s in sides.items()})
    print(json.dumps(result))


if __name__ == "__main__":
    main()
