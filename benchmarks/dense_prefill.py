"""Prompt processing time with and without `--dense-prefill` (CPU, 4-bit weights), engine only, side by side.

For each prompt length: the median of 5 runs of a 1-token generation (prefill + the first token), prefix cache off,
with the default model loaded twice in one process: once keeping bf16 copies for prompt tokens, once int4 only.

    python benchmarks/dense_prefill.py [--lengths 1,16,64,256,512] [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from edgeserve import LLM, SamplingParams
from edgeserve.models.load import load_model
from edgeserve.registry import resolve

TEXT = "the quick brown fox jumps over the lazy dog and then " * 200


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", default="1,16,64,256,512")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    llms = {mode: LLM.from_model(load_model(resolve(args.model), dense_prefill=mode), kv_cache_gb=0.1,
                                 enable_prefix_caching=False) for mode in ("on", "off")}
    ids = llms["on"].tokenizer.encode(TEXT)
    params = SamplingParams(temperature=0, max_tokens=1)
    print(f"{'prompt tokens':>13} {'dense on ms':>12} {'int4 only ms':>13} {'ratio':>6}")
    for n in lengths:
        ms = {}
        for mode in ("on", "off"):  # alternate sides per length so drift hits both
            llm = llms[mode]
            llm.generate([ids[:n]], params)
            times = []
            for _ in range(args.runs):
                t = time.perf_counter()
                llm.generate([ids[:n]], params)
                times.append(time.perf_counter() - t)
            ms[mode] = statistics.median(times) * 1e3
        print(f"{n:>13} {ms['on']:>12.1f} {ms['off']:>13.1f} {ms['off'] / ms['on']:>5.2f}x", flush=True)


if __name__ == "__main__":
    main()
