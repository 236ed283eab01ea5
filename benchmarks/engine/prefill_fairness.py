"""Fair admission: time to first token of a short request that arrives while a long prompt prefills, first come
first served (the old scheduler) vs the fair split of the prompt-token budget, side by side in one process.

Each round, for each policy (alternating, so machine noise hits both alike): the short request alone (its unloaded
TTFT), then a long prompt (default 6025 tokens, the issue's case) with the short one added after the long one's
second step. Reports medians: the short request's TTFT and steps to its first token, its ratio to the unloaded TTFT,
and the long prompt's own TTFT (what fairness costs it).

    python benchmarks/engine/prefill_fairness.py [--long-tokens 6025] [--rounds 3] [--max-batched-tokens 512]

`--late-depth N [--shorts K]` (issue 39): both policies fair, the prompt-token budget alone ("budget",
bound_prefill_steps off) vs steps bounded by cost ("bounded", the default); K short requests arrive together once
the long prompt has N tokens computed, so each step of the long one attends to N keys or more.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--long-tokens", type=int, default=6025)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-batched-tokens", type=int, default=512)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--late-depth", type=int, help="short requests arrive once the long prompt has this many tokens")
    ap.add_argument("--shorts", type=int, default=1, help="with --late-depth: short requests arriving together")
    a = ap.parse_args()

    from edgeserve.engine.config import EngineConfig
    from edgeserve.engine.core import EngineCore
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve
    from edgeserve.sampling_params import SamplingParams

    lm = load_model(resolve(a.model))
    tok = lm.tokenizer
    short = tok.encode(lm.chat_template.render([{"role": "user", "content": "Say hi"}], add_generation_prompt=True),
                       add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)  # TTFT is all that is measured

    def long_prompt(seed: int) -> list[int]:  # new text each run: nothing comes from the prefix cache
        text = " ".join(f"message {seed}-{i}: hello there." for i in range(a.long_tokens))
        return tok.encode(text, add_special_tokens=False)[: a.long_tokens]

    def engine(fair: bool, bounded: bool = True) -> EngineCore:
        core = EngineCore(lm, EngineConfig(kv_cache_gb=0.5, max_num_batched_tokens=a.max_batched_tokens,
                                           max_model_len=a.long_tokens + 64))
        core.scheduler.config = replace(core.scheduler.config, fair_prefill=fair, bound_prefill_steps=bounded)
        return core

    def first_tokens(core: EngineCore, arrivals: dict[str, float], steps0: dict[str, int]):
        """Drive to the end: {request: (seconds to first token, steps to first token)}."""
        first: dict[str, tuple[float, int]] = {}
        while core.has_work():
            for out in core.step():
                if out.token_ids and out.request_id not in first:
                    first[out.request_id] = (time.perf_counter() - arrivals[out.request_id],
                                             core.num_steps - steps0[out.request_id])
        return first

    def short_alone(fair: bool, k: int = 1) -> float:
        """Median TTFT of `k` short requests arriving together on an idle engine."""
        alone = engine(fair)
        t0 = time.perf_counter()
        rids = [f"short{i}" for i in range(k)]
        for rid in rids:
            alone.add_request(short, params, rid)
        first = first_tokens(alone, dict.fromkeys(rids, t0), dict.fromkeys(rids, 0))
        return statistics.median(first[r][0] for r in rids)

    def run(fair: bool, seed: int) -> dict[str, float]:
        unloaded = short_alone(fair)
        core = engine(fair)
        arrivals, steps0 = {"long": time.perf_counter()}, {"long": 0}
        core.add_request(long_prompt(seed), params, "long")
        core.step()
        core.step()
        arrivals["short"], steps0["short"] = time.perf_counter(), core.num_steps
        core.add_request(short, params, "short")
        first = first_tokens(core, arrivals, steps0)
        return {"short_unloaded_s": unloaded, "short_ttft_s": first["short"][0], "short_steps": first["short"][1],
                "long_ttft_s": first["long"][0]}

    def run_late(bounded: bool, seed: int) -> dict[str, float]:
        """The long prompt prefills alone to --late-depth, then --shorts short requests arrive together."""
        unloaded = short_alone(True, a.shorts)  # as many arriving together on an idle engine
        core = engine(True, bounded)
        arrivals, steps0 = {"long": time.perf_counter()}, {"long": 0}
        core.add_request(long_prompt(seed), params, "long")
        core.step()  # admits it
        while core.requests["long"].num_computed_tokens < a.late_depth:
            core.step()
        depth = core.requests["long"].num_computed_tokens
        shorts = [f"short{i}" for i in range(a.shorts)]
        for rid in shorts:
            arrivals[rid], steps0[rid] = time.perf_counter(), core.num_steps
            core.add_request(short, params, rid)
        first = first_tokens(core, arrivals, steps0)
        ttft = statistics.median(first[r][0] for r in shorts)
        return {"short_unloaded_s": unloaded, "short_ttft_s": ttft, "short_ttft_max_s": max(first[r][0] for r in shorts),
                "short_steps": max(first[r][1] for r in shorts), "depth_at_arrival": depth,
                "long_ttft_s": first["long"][0]}

    short_alone(True)  # warm-up
    names = ("budget", "bounded") if a.late_depth else ("fcfs", "fair")
    results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for r in range(a.rounds):
        for name in names:
            results[name].append(run_late(name == "bounded", r) if a.late_depth else run(name == "fair", r))
            print(name, r, results[name][-1], file=sys.stderr, flush=True)
    summary = {}
    for name, runs in results.items():
        med = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
        summary[name] = {**{k: round(v, 3) for k, v in med.items()},
                         "short_ttft_over_unloaded": round(med["short_ttft_s"] / med["short_unloaded_s"], 1)}
    first, second = names
    print(json.dumps({"long_tokens": a.long_tokens, "short_tokens": len(short), "late_depth": a.late_depth,
                      "shorts": a.shorts, "max_batched_tokens": a.max_batched_tokens, "rounds": a.rounds,
                      "medians": summary,
                      f"{second}_vs_{first}_short_ttft": round(summary[first]["short_ttft_s"]
                                                               / summary[second]["short_ttft_s"], 1),
                      "runs": results}, indent=1))


if __name__ == "__main__":
    main()
