"""Prefix cache: time to first token for a request whose long prefix (default 1000 tokens) is cached vs not.

Alternates cold, warm and again requests in one process; a cold request's prefix is new text (never seen), a warm
one's prefix was computed by the previous request, so only its own question is prefilled, and "again" is the cold
request's whole prompt sent again (only its last token is computed: the partly filled last block is reused from a
copy). Reports medians.

    python benchmarks/engine/prefix_cache_ttft.py [--prefix-tokens 1000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", default="smollm2-135m")
    a = ap.parse_args()

    from edgeserve import LLM, SamplingParams

    llm = LLM(a.model, kv_cache_gb=1.0)
    tok = llm.tokenizer

    def prefix(seed: int) -> list[int]:
        words = [f"note{seed}-{i}" for i in range(a.prefix_tokens)]
        return tok.encode(" ".join(words))[: a.prefix_tokens]

    first_token = SamplingParams(temperature=0, max_tokens=1)

    def ttft(ids: list[int]) -> float:
        start = time.perf_counter()
        llm.generate([ids], first_token)
        return time.perf_counter() - start

    question = tok.encode(" Question: what was the first note?")
    llm.generate([prefix(-1) + question], first_token)  # warm-up
    times: dict[str, list[float]] = {"cold": [], "warm": [], "again": []}
    cached: list[int] = []
    again_cached: list[int] = []
    for r in range(a.rounds):
        shared = prefix(r)
        times["cold"].append(ttft(shared + question))  # computes the prefix and caches it
        before = llm.engine.scheduler.block_manager.num_prompt_tokens_reused
        times["warm"].append(ttft(shared + tok.encode(f" Question {r}: what was the last note?")))
        cached.append(llm.engine.scheduler.block_manager.num_prompt_tokens_reused - before)
        before = llm.engine.scheduler.block_manager.num_prompt_tokens_reused
        times["again"].append(ttft(shared + question))
        again_cached.append(llm.engine.scheduler.block_manager.num_prompt_tokens_reused - before)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({
        "prefix_tokens": a.prefix_tokens, "tokens_reused_per_warm_request": cached,
        "tokens_reused_per_again_request": again_cached, "prompt_tokens_of_again": len(prefix(0) + question),
        "ttft_ms_median": {k: round(v * 1000, 1) for k, v in med.items()},
        "runs_ms": {k: [round(x * 1000, 1) for x in v] for k, v in times.items()},
        "speedup": round(med["cold"] / med["warm"], 1),
    }, indent=2))


if __name__ == "__main__":
    main()
