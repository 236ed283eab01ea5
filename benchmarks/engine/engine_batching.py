"""Continuous batching: aggregate generated tokens/s of N requests run together vs the same N one after another.

Both sides use the same engine and model in one process, alternating rounds so machine drift hits both;
reports medians and the ratio. Every request generates exactly --max-tokens tokens (end-of-turn ignored).

    python benchmarks/engine/engine_batching.py [--requests 32] [--max-tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default="smollm2-135m")
    a = ap.parse_args()

    from edgeserve import LLM, SamplingParams

    llm = LLM(a.model, kv_cache_gb=1.0, max_num_seqs=max(a.requests, 1), enable_prefix_caching=False)
    topics = ["the sea", "a clock", "bread", "winter", "a violin", "rivers", "chess", "bees"]
    prompts = []
    for i in range(a.requests):
        text = f"Write a story about {topics[i % 8]}." + " Make it vivid." * (i % 5)
        prompts.append(llm.tokenizer.encode(llm.lm.chat_template.render([{"role": "user", "content": text}]),
                                            add_special_tokens=False))
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    total = a.requests * a.max_tokens

    def together() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params)
        return total / (time.perf_counter() - start)

    def one_by_one() -> float:
        start = time.perf_counter()
        for p in prompts:
            llm.generate([p], params)
        return total / (time.perf_counter() - start)

    llm.generate(prompts[:2], params)  # warm-up
    rates: dict[str, list[float]] = {"together": [], "one_by_one": []}
    for _ in range(a.rounds):
        rates["together"].append(together())
        rates["one_by_one"].append(one_by_one())
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(json.dumps({
        "requests": a.requests, "max_tokens": a.max_tokens,
        "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
        "tokens_per_s_median": {k: round(v, 1) for k, v in med.items()},
        "runs": {k: [round(x, 1) for x in v] for k, v in rates.items()},
        "ratio_together_vs_one_by_one": round(med["together"] / med["one_by_one"], 2),
    }, indent=2))


if __name__ == "__main__":
    main()
