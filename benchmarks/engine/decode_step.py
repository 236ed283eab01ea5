"""Time of one greedy decode step through the engine, this checkout against another git revision, side by side.

Each side runs in its own process (the two code versions cannot share one); the sides alternate A/B/A/B for
`--rounds` rounds. In each process the default model is loaded once, then for every batch size B, B copies of a
chat prompt generate `--tokens` tokens; step time = (time to N tokens - time to 1 token) / (N - 1), so prefill
is excluded. Reports per-side medians over rounds, the ratio, and whether the generated token ids are identical.

    python benchmarks/engine/decode_step.py --against 2db8d7e [--rounds 4] [--tokens 48] [--batch 1,4] [--model GGUF]
    python benchmarks/engine/decode_step.py --side    # one process, this checkout only: prints JSON

With `--count-ops`, each side also counts the aten ops of one batch-1 decode step (torch profiler events, every
nested call included; machine-independent, unlike the times).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

PROMPT = "Write a long story about a lighthouse keeper and a storm."


def count_ops(llm, ids: list[int]) -> int:
    """aten ops (profiler events, nested calls included) per batch-1 decode step, averaged over 4 steps."""
    from torch.profiler import ProfilerActivity, profile

    from edgeserve import SamplingParams

    engine = llm.engine
    engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.step()  # prefill
    engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            engine.step()
    while engine.has_work():
        engine.step()
    return sum(1 for e in prof.events() if e.name.startswith("aten::")) // 4


def side(tokens: int, batches: list[int], repeats: int, ops: bool = False, model: str = "smollm2-135m") -> dict:
    """Median decode step ms per batch size, and a digest of the generated ids, for the importable edgeserve."""
    import edgeserve
    from edgeserve import LLM, SamplingParams

    llm = LLM(model, kv_cache_gb=0.25, enable_prefix_caching=False)
    msgs = [{"role": "user", "content": PROMPT}]
    ids = llm.lm.tokenizer.encode(llm.lm.chat_template.render(msgs, add_generation_prompt=True),
                                  add_special_tokens=False)

    def run(b: int, n: int) -> tuple[float, list]:
        start = time.perf_counter()
        out = llm.generate([ids] * b, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - start, [o.outputs[0].token_ids for o in out]

    run(1, 4)  # warm-up
    import edgeserve.kernels

    result: dict = {"edgeserve": [edgeserve.__file__, edgeserve.kernels.__file__], "step_ms": {}, "digest": {}}
    if ops:
        result["ops_per_step"] = count_ops(llm, ids)
        return result
    for b in batches:
        steps, outs = [], []
        for _ in range(repeats):
            t1, _ = run(b, 1)
            tn, outs = run(b, tokens)
            steps.append((tn - t1) / (tokens - 1) * 1e3)
        result["step_ms"][b] = statistics.median(steps)
        result["digest"][b] = hashlib.sha256(json.dumps(outs).encode()).hexdigest()[:16]
    return result


def against_this_checkout(revs: list[str], cmd: list[str], rounds: int, show) -> dict[str, list[dict]]:
    """`cmd` run alternately in a worktree of each of `revs` and in this checkout (edgeserve.bench.checkout); the
    runs' JSON per side, "this checkout" last."""
    from edgeserve.bench.checkout import alternate_trees, remove_worktree, worktree

    here = Path(__file__).resolve().parents[2]
    trees = {rev: worktree(rev, here) for rev in revs}
    try:
        return alternate_trees({**trees, "this checkout": here}, cmd, rounds, show)
    finally:
        for tree in trees.values():
            remove_worktree(tree, here)


def alternation_parser(description: str, against_help: str, rounds: int, tokens: int, batch: str,
                       repeats_help: str) -> argparse.ArgumentParser:
    """The options of a script here that runs itself (--side) in trees of other revisions (--against) through
    against_this_checkout: --against, --side, --rounds, --tokens, --batch, --repeats, with these defaults and helps.
    (Here, not in edgeserve: a --side run imports the other revision's edgeserve, which may lack it.)"""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--against", help=against_help)
    ap.add_argument("--side", action="store_true", help="measure the importable edgeserve only, print JSON")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--tokens", type=int, default=tokens)
    ap.add_argument("--batch", default=batch)
    ap.add_argument("--repeats", type=int, default=3, help=repeats_help)
    return ap


def main() -> None:
    ap = alternation_parser(__doc__.splitlines()[0], "git revision to compare with (side A); this checkout is side B",
                            rounds=4, tokens=48, batch="1,4", repeats_help="generations per batch size in one process")
    ap.add_argument("--model", default="smollm2-135m", help="model name or GGUF path")
    ap.add_argument("--count-ops", action="store_true", help="only count aten ops per batch-1 decode step")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    if args.side or not args.against:
        print(json.dumps(side(args.tokens, batches, args.repeats, args.count_ops, args.model)))
        return
    cmd = [sys.executable, __file__, "--side", "--tokens", str(args.tokens), "--batch", args.batch,
           "--repeats", str(args.repeats), "--model", args.model] + (["--count-ops"] if args.count_ops else [])
    results = against_this_checkout([args.against], cmd, args.rounds,
                                    lambda r, name, out: print(f"round {r} {name}: {out}", flush=True))
    a, b = args.against, "this checkout"
    if args.count_ops:
        print(f"aten ops per batch-1 decode step: {a} {results[a][0]['ops_per_step']}, "
              f"this checkout {results[b][0]['ops_per_step']}")
        return
    for name in results:
        print(f"{name}: edgeserve from {results[name][0]['edgeserve']}")
    for bs in batches:
        key = str(bs)
        ma = statistics.median(x["step_ms"][key] for x in results[a])
        mb = statistics.median(x["step_ms"][key] for x in results[b])
        same = {x["digest"][key] for x in results[a]} == {x["digest"][key] for x in results[b]}
        print(f"batch {bs}: {a} {ma:.2f} ms/step, this checkout {mb:.2f} ms/step, speed-up {ma / mb:.2f}x, "
              f"identical outputs: {same}")


if __name__ == "__main__":
    main()
