"""Decode latency of short requests while a long prompt prefills, with and without the scheduler's decode-slowdown
limit (`max_decode_slowdown`), side by side in one process: compare.py's prefill-interference workload driven
straight through EngineCore (no HTTP), so the two policies see the same machine at the same time.

Each round, for each policy (alternating order): three short requests (16-token prompts, 32 output tokens) alone,
then a long prompt (default 4,000 tokens, 4 output tokens) with the three short ones added after its first step.
Reports medians over rounds: p99 TPOT of the short requests unloaded and during the prefill (TPOT = (last token
time - first token time) / (tokens - 1), as compare.py), their ratio, the short requests' TTFT and the long
prompt's TTFT (what the limit costs it).

    python benchmarks/engine/prefill_interference.py [--long-tokens 4000] [--rounds 3] [--slowdown 1.5]

`--late-depth N`: the short requests arrive once the long prompt has N tokens computed (deep into it, where one
prompt token beside the decode rows may cost more than a decode step); the policies are then the limit with its token floor paid every step (`floor every step`, as before the
pacing), the limit as it is (`paced`, prompt_pacing.FloorPacer) and no limit, and besides the long prompt's TTFT
each reports its tokens computed while the short requests ran (what the policy costs it); the
unloaded figure is then the mean of runs just before and just after the loaded one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--long-tokens", type=int, default=4000)
    ap.add_argument("--short-tokens", type=int, default=32)
    ap.add_argument("--shorts", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--slowdown", type=float, default=1.5, help="max_decode_slowdown of the limited policy")
    ap.add_argument("--max-batched-tokens", type=int, default=512)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--late-depth", type=int, help="short requests arrive once the long prompt has this many tokens")
    ap.add_argument("--policies", help="with --late-depth: a comma list of 'floor every step', 'paced', 'no limit'")
    a = ap.parse_args()

    from edgeserve.engine.config import EngineConfig
    from edgeserve.engine.core import EngineCore
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve
    from edgeserve.sampling_params import SamplingParams

    lm = load_model(resolve(a.model))
    core = EngineCore(lm, EngineConfig(kv_cache_gb=0.5, max_num_seqs=8, max_num_batched_tokens=a.max_batched_tokens,
                                       max_model_len=a.long_tokens + 64))
    vocab = lm.config.vocab_size
    short_params = SamplingParams(temperature=0, max_tokens=a.short_tokens, ignore_eos=True)
    long_params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def run(requests: list[tuple[str, list[int], SamplingParams]], after_first_step: list) -> dict[str, list[float]]:
        """Add `requests`, then `after_first_step` once one step ran; drive to the end. Each request's token
        times, from its arrival (its first entry)."""
        times: dict[str, list[float]] = {}
        for rid, ids, params in requests:
            core.add_request(ids, params, rid)
            times[rid] = [time.perf_counter()]
        pending = after_first_step
        while core.has_work():
            outs = core.step()
            now = time.perf_counter()
            for out in outs:
                times[out.request_id].extend([now] * len(out.token_ids))
            for rid, ids, params in pending:
                core.add_request(ids, params, rid)
                times[rid] = [time.perf_counter()]
            pending = []
        return times

    def p99_tpot(times: dict[str, list[float]], rids: list[str]) -> float:
        tpot = [(t[-1] - t[1]) / (len(t) - 2) for rid in rids for t in [times[rid]] if len(t) > 2]
        return float(np.percentile(tpot, 99)) * 1000

    rng = np.random.default_rng(0)

    def ids(n: int) -> list[int]:  # new tokens every run: nothing comes from the prefix cache
        return rng.integers(100, vocab - 100, n).tolist()

    def run_late(long_id: str, shorts: list[str]) -> tuple[dict[str, list[float]], int, float]:
        """The long prompt alone to --late-depth tokens, then the short requests beside it until they end, then
        the long prompt to its first token. The short requests' token times, the long prompt's tokens computed
        while they ran, and its TTFT in ms."""
        arrival = time.perf_counter()
        core.add_request(ids(a.long_tokens), long_params, long_id)
        core.step()
        long_seq = core.scheduler.get(long_id)
        while long_seq.num_computed_tokens < a.late_depth:
            core.step()
        depth = long_seq.num_computed_tokens
        times = {rid: [time.perf_counter()] for rid in shorts}
        for rid in shorts:
            core.add_request(ids(16), short_params, rid)
        ttft = None
        while any(len(times[rid]) <= a.short_tokens for rid in shorts):
            outs = core.step()
            now = time.perf_counter()
            for out in outs:
                if out.request_id in times:
                    times[out.request_id].extend([now] * len(out.token_ids))
                elif out.request_id == long_id and out.token_ids and ttft is None:
                    ttft = (now - arrival) * 1000
        gained = long_seq.num_computed_tokens - depth
        while ttft is None:
            if any(out.request_id == long_id and out.token_ids for out in core.step()):
                ttft = (time.perf_counter() - arrival) * 1000
        core.finish_request(long_id)
        while core.has_work():
            core.step()
        return times, gained, ttft

    if a.late_depth is None:
        policies: dict[str, tuple[float | None, int]] = {"no limit": (None, 16), f"limit {a.slowdown:g}": (a.slowdown, 16)}
    else:
        every = {"floor every step": (a.slowdown, 0), "paced": (a.slowdown, 16), "no limit": (None, 16)}
        policies = {p: every[p] for p in (a.policies.split(",") if a.policies else every)}
    results: dict[str, dict[str, list[float]]] = {p: {} for p in policies}
    run([("warm", ids(16), short_params)], [])
    for rnd in range(a.rounds):
        order = list(policies.items()) if rnd % 2 == 0 else list(reversed(policies.items()))
        for name, (slowdown, max_gap) in order:
            core.scheduler.config = replace(core.scheduler.config, max_decode_slowdown=slowdown)
            core.scheduler.pacer.max_gap = max_gap  # 0: the owed token is paid every step
            shorts = [f"r{rnd}-{name}-s{i}" for i in range(a.shorts)]
            alone = run([(rid, ids(16), short_params) for rid in shorts], [])
            loaded_ids = [rid + "-loaded" for rid in shorts]
            if a.late_depth is not None:
                loaded, gained, long_ttft = run_late("long" + shorts[0], loaded_ids)
                after = [rid + "-after" for rid in shorts]  # unloaded again, right after: the load drifts
                alone_after = run([(rid, ids(16), short_params) for rid in after], [])
                r = results[name]
                unloaded = (p99_tpot(alone, shorts) + p99_tpot(alone_after, after)) / 2
                during = p99_tpot(loaded, loaded_ids)
                for key, value in [("p99 TPOT ms, unloaded", unloaded), ("p99 TPOT ms, beside the deep prompt", during),
                                   ("ratio", during / unloaded),
                                   ("mean TPOT ms, beside", statistics.mean(
                                       (t[-1] - t[1]) / (len(t) - 2) * 1000 for t in loaded.values())),
                                   ("long prompt tokens meanwhile", gained), ("long prompt TTFT ms", long_ttft)]:
                    r.setdefault(key, []).append(value)
                print(json.dumps({"round": rnd + 1, "policy": name, **{k: round(v[-1], 2) for k, v in r.items()}}),
                      flush=True)
                continue
            loaded = run([("long" + shorts[0], ids(a.long_tokens), long_params)],
                         [(rid, ids(16), short_params) for rid in loaded_ids])
            r = results[name]
            unloaded, during = p99_tpot(alone, shorts), p99_tpot(loaded, loaded_ids)
            for key, value in [("p99 TPOT ms, unloaded", unloaded), ("p99 TPOT ms, during the prefill", during),
                               ("ratio", during / unloaded),
                               ("short TTFT ms, median", statistics.median(
                                   (loaded[rid][1] - loaded[rid][0]) * 1000 for rid in loaded_ids)),
                               ("long prompt TTFT ms", (loaded["long" + shorts[0]][1]
                                                        - loaded["long" + shorts[0]][0]) * 1000)]:
                r.setdefault(key, []).append(value)
            print(json.dumps({"round": rnd + 1, "policy": name, **{k: round(v[-1], 2) for k, v in r.items()}}),
                  flush=True)
    print(f"{a.rounds} rounds, medians ({a.long_tokens}-token prompt, {a.shorts} short requests of "
          f"{a.short_tokens} tokens, max_num_batched_tokens {a.max_batched_tokens}"
          + (f", arriving at depth {a.late_depth})" if a.late_depth is not None else ")"))
    for name, r in results.items():
        print(f"  {name:>10}: " + ", ".join(f"{k} {statistics.median(v):.1f}" if k != "ratio" else
                                            f"{k} {statistics.median(v):.2f}x" for k, v in r.items()))


if __name__ == "__main__":
    main()
