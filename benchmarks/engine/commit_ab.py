"""Decode speed of two commits or two source trees, side by side in one invocation ("speed unchanged", issue 48).

Each commit is checked out into a temporary git worktree (edgeserve.bench.checkout); one worker process per side
imports that worktree only (PYTHONPATH), so each side builds and loads its own native library from its own
kernels/cpu sources (cached by source hash). With `--python A,B` instead, the sides are two interpreters that each
import their own edgeserve (e.g. a worktree at the commit before a change with its own editable install, and this
one). Both workers load the same model once; then runs alternate between the sides (old/new, new/old, ...) for
`--rounds` rounds. What a run times (`--measure`):

- `generate` (default): B copies of a chat prompt generate 1 and then `--tokens` tokens through the engine, greedy;
  step time = (time to N tokens - time to 1 token) / (N - 1), so prefill is excluded.
- `step`: the model alone (dtype auto, on whatever path it takes: the fused native stack where it applies) fills a
  paged pool with B sequences of `--context` tokens, then `--steps` decode steps (forward + logits, one intra-op
  thread, the first untimed) at batch B; step time = their median.

Prints per side the median step (ms), the ratio new/old (below 1.0: new is faster), whether both sides generated
the same ids (`step`: the same argmax ids of the same seeded inputs), and the library each side loaded, as JSON on
the last line.

    python benchmarks/engine/commit_ab.py --old 9e71e6a --new HEAD [--model smollm2-135m | GGUF] [--rounds 8]
        [--tokens 32] [--batch 1] [--measure step [--context 64] [--steps 12]]
    python benchmarks/engine/commit_ab.py --python /tmp/before/.venv/bin/python,.venv/bin/python -m MODEL.gguf \\
        --measure step [--batch 1] [--context 64] [--steps 12] [--rounds 4]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

PROMPT = "Write a long story about a lighthouse keeper and a storm."
REPO = Path(__file__).resolve().parents[2]


def _library_info() -> dict:
    """Which files the importable edgeserve came from, the native library it loaded and its thread count."""
    import edgeserve
    import edgeserve.kernels
    try:  # kernels by backend (after 2026-12-02); older commits keep the flat kernels/
        from edgeserve.kernels.cpu import native as cpu_native
    except ImportError:
        from edgeserve.kernels import cpu_native

    lib = cpu_native.library()
    return {"edgeserve": [edgeserve.__file__, edgeserve.kernels.__file__], "library": getattr(lib, "_name", None),
            "threads": cpu_native.threads()}


def this_checkouts_timing():
    """This checkout's edgeserve/bench/timing.py (stdlib only), loaded by path: both sides time with the same code,
    whatever the side's own tree holds."""
    spec = importlib.util.spec_from_file_location("commit_ab_timing", REPO / "edgeserve" / "bench" / "timing.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look themselves up
    spec.loader.exec_module(module)
    return module


def _digest(ids) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def generate_run(model: str, tokens: int, batch: int) -> Callable[[], dict]:
    """`--measure generate`: load `model` in an LLM; each call is one decode run's {"step_ms", "digest"}."""
    from edgeserve import LLM, SamplingParams

    llm = LLM(model, kv_cache_gb=0.25, enable_prefix_caching=False)
    ids = llm.lm.tokenizer.encode(llm.lm.chat_template.render([{"role": "user", "content": PROMPT}],
                                                               add_generation_prompt=True), add_special_tokens=False)

    def run(n: int) -> tuple[float, list]:
        start = time.perf_counter()
        out = llm.generate([ids] * batch, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - start, [o.outputs[0].token_ids for o in out]

    def one() -> dict:
        t1, _ = run(1)
        tn, outs = run(tokens)
        return {"step_ms": (tn - t1) / (tokens - 1) * 1e3, "digest": _digest(outs)}

    run(4)  # warm-up
    return one


def step_run(model_path: str, steps: int, batch: int, context: int) -> Callable[[], dict]:
    """`--measure step`: load the model alone; each call fills a paged pool with `batch` sequences of `context`
    seeded tokens and times `steps` decode steps (the first untimed): {"step_ms": median, "digest": argmax ids}."""
    import torch

    try:  # the engine in wings (after 2026-12-03); older trees keep the flat engine/
        from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention
    except ImportError:
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

    def one() -> dict:
        gen = torch.Generator().manual_seed(0)
        pool = KVPool(model.config, b * per_seq, block, model.dtype)
        ids, pos = torch.randint(100, 1000, (b * p,), generator=gen), torch.arange(p).repeat(b)
        slots = [tables[i][q // block] * block + q % block for i in range(b) for q in range(p)]
        model.forward(ids, pos, PagedKVAttention(pool, AttentionMetadata.build([p] * b, [p] * b, tables, slots)))
        argmax, n = [], p

        def step() -> None:
            nonlocal n
            meta = AttentionMetadata.build([1] * b, [n + 1] * b, tables,
                                           [tables[i][n // block] * block + n % block for i in range(b)])
            logits = model.logits(model.forward(torch.randint(100, 1000, (b,), generator=gen), torch.full((b,), n),
                                                PagedKVAttention(pool, meta)))
            argmax.append(logits.argmax(-1).tolist())
            n += 1

        with intra_op_threads(1):
            times = this_checkouts_timing().call_times(step, steps - 1, warmup=1)
        return {"step_ms": statistics.median(times) * 1e3, "digest": _digest(argmax)}

    return one


def worker(args: argparse.Namespace) -> None:
    """One side: load the model with the importable edgeserve, then answer each stdin line with one run's JSON
    ({"step_ms", "digest"}); the first line out says which files were imported and which library loaded."""
    if args.measure == "step":
        one = step_run(args.model, args.steps, args.batch, args.context)
    else:
        one = generate_run(args.model, args.tokens, args.batch)
    print(json.dumps(_library_info()), flush=True)
    for _ in sys.stdin:
        print(json.dumps(one()), flush=True)


class Side:
    """A worker process over one commit's worktree (or one interpreter's own edgeserve)."""

    def __init__(self, python: str, tree: Path | None, args: argparse.Namespace) -> None:
        """`python` runs the worker; with a `tree`, it imports that tree only (PYTHONPATH, run from there)."""
        env = dict(os.environ, PYTHONPATH=str(tree)) if tree else None
        cmd = [python, str(Path(__file__).resolve()), "--worker", "--measure", args.measure, "--model", args.model,
               "--tokens", str(args.tokens), "--batch", str(args.batch), "--context", str(args.context),
               "--steps", str(args.steps)]
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


def parse_args() -> argparse.Namespace:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", help="git revision of the baseline side")
    ap.add_argument("--new", default="HEAD", help="git revision of the other side (default HEAD)")
    ap.add_argument("--python", help="instead of --old/--new: two interpreters, comma-separated (old,new), each "
                                     "importing its own edgeserve")
    ap.add_argument("-m", "--model", default="smollm2-135m", help="model name or GGUF path")
    ap.add_argument("--measure", choices=("generate", "step"), default="generate",
                    help="generate: engine decode runs; step: the model's own decode steps over a filled pool")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32, help="generate: tokens per run")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=64, help="step: tokens in each sequence's pool before the steps")
    ap.add_argument("--steps", type=int, default=12, help="step: decode steps per run (the first untimed)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.worker and not args.old and not args.python:
        ap.error("--old REV (or --python OLD,NEW) is required")
    if args.python and len(args.python.split(",")) != 2:
        ap.error("--python takes two interpreters, comma-separated")
    if Path(args.model).exists():  # the commit sides run from their worktrees
        args.model = str(Path(args.model).resolve())
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    from edgeserve.bench.checkout import remove_worktree, short_commit, worktree

    if args.python:
        labels = dict(zip(("old", "new"), args.python.split(",")))
        trees: dict[str, Path] = {}
    else:
        labels = {"old": short_commit(args.old, REPO), "new": short_commit(args.new, REPO)}
        trees = {name: worktree(rev, REPO) for name, rev in labels.items()}
    sides: dict[str, Side] = {}
    try:
        for name, label in labels.items():  # one at a time: each may build its library first
            sides[name] = Side(label if args.python else sys.executable, trees.get(name), args)
            print(f"{name} {label}: {sides[name].info}", flush=True)
        result = compare(sides, args.rounds)
    finally:
        for side in sides.values():
            side.close()
        for tree in trees.values():
            remove_worktree(tree, REPO)
    result.update({"pythons" if args.python else "commits": labels}, model=args.model, measure=args.measure,
                  batch=args.batch, rounds=args.rounds, sides={n: s.info for n, s in sides.items()},
                  **({"context": args.context, "steps": args.steps} if args.measure == "step"
                     else {"tokens": args.tokens}))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
