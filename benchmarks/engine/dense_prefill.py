"""Prompt processing time with and without `--dense-prefill` (CPU, 4-bit weights), engine only, side by side.

For each prompt length: the median of 5 runs of a 1-token generation (prefill + the first token), prefix cache off,
with the default model loaded twice in one process: once keeping bf16 copies for prompt tokens, once int4 only.

    python benchmarks/engine/dense_prefill.py [--lengths 1,16,64,256,512] [--runs 5] [--native]

With `--native` the two sides are instead the native quantized GEMM (kernels/cpu/src/qmm/, EDGESERVE_NATIVE=1,
no dense copies) and the torch path with dense copies (EDGESERVE_NATIVE=0, `--dense-prefill on`); the environment
is switched per side for loading and for every run.
"""

from __future__ import annotations

import argparse
import os
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
    ap.add_argument("--native", action="store_true", help="native GEMM (side 'off') against torch + dense copies")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    env = os.environ.get("EDGESERVE_NATIVE", "1")
    native = {"on": "0", "off": "1"} if args.native else {"on": env, "off": env}
    llms = {}
    for mode in ("on", "off"):
        os.environ["EDGESERVE_NATIVE"] = native[mode]
        llms[mode] = LLM.from_model(load_model(resolve(args.model), dense_prefill=mode), kv_cache_gb=0.1,
                                    enable_prefix_caching=False)
    ids = llms["on"].tokenizer.encode(TEXT)
    params = SamplingParams(temperature=0, max_tokens=1)
    names = ("dense+torch ms", "native ms") if args.native else ("dense on ms", "int4 only ms")
    print(f"{'prompt tokens':>13} {names[0]:>14} {names[1]:>13} {'ratio':>6}")
    for n in lengths:
        ms = {}
        for mode in ("on", "off"):  # alternate sides per length so drift hits both
            llm = llms[mode]
            os.environ["EDGESERVE_NATIVE"] = native[mode]
            llm.generate([ids[:n]], params)
            times = []
            for _ in range(args.runs):
                t = time.perf_counter()
                llm.generate([ids[:n]], params)
                times.append(time.perf_counter() - t)
            ms[mode] = statistics.median(times) * 1e3
        print(f"{n:>13} {ms['on']:>14.1f} {ms['off']:>13.1f} {ms['off'] / ms['on']:>5.2f}x", flush=True)


if __name__ == "__main__":
    main()
