"""Where a batch-1 decode step's time goes: torch profiler table of aten ops over one greedy generation.

    python benchmarks/engine/profile_decode.py [--tokens 32] [--model GGUF] [--batch 8]
"""

from __future__ import annotations

import argparse

from torch.profiler import ProfilerActivity, profile

from edgeserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1, help="prompts generated together (each its own numbered text)")
    args = ap.parse_args()
    llm = LLM(args.model, kv_cache_gb=0.1)
    ids = [llm.tokenizer.encode(f"Write a long story {i} about a dragon and a knight.") for i in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(ids, params)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(ids, params)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
