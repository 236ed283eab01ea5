"""The sampler's cost per decode step at batch 8 with and without grammars, over the default model's vocabulary
(49,152), interleaved, medians and ratios.

    python benchmarks/engine/grammar_sampler.py [--steps 40] [--repeats 5] [--threads N]

Cases: 8 plain rows; 8 rows under a JSON schema (each advanced along a valid document of its own, so every step
computes a real mask); 4 plain + 4 constrained. Logits are random (the mask cost does not depend on them); rows
sample at temperature 1. The grammar states are stepped through the document's tokens whatever was sampled.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from edgeserve.engine.runner.sampler import sample_tokens
from edgeserve.loaders.gguf_file import GGUFFile
from edgeserve.loaders.tokenizer import tokenizer_from_gguf
from edgeserve.registry import DEFAULT_MODEL, pull
from edgeserve.sampling_params import SamplingParams
from edgeserve.text.grammar import GrammarCompiler

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}


def _doc(i: int) -> str:
    return json.dumps({"name": f"Person number {i} with a longish name", "age": 20 + i,
                       "tags": ["alpha", "gamma", "beta"][: 1 + i % 3],
                       "address": {"city": f"City {i} of the north", "zip": f"{10000 + i}"}})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tok = tokenizer_from_gguf(GGUFFile(pull(DEFAULT_MODEL, progress=False)).metadata)
    vocab = 49152
    compiler = GrammarCompiler.for_tokenizer(tok, vocab)
    plain = SamplingParams(temperature=1.0)
    constrained = SamplingParams(temperature=1.0, json_schema=SCHEMA)
    docs = [tok.encode(_doc(i), add_special_tokens=False) for i in range(8)]
    steps = min(args.steps, min(len(d) for d in docs))
    cases = {"8 plain": [False] * 8, "8 json_schema": [True] * 8, "4 plain + 4 json_schema": [False, True] * 4}
    torch.manual_seed(0)
    logits = [torch.randn(8, vocab) for _ in range(steps)]
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, flags in cases.items():  # interleaved, so load changes hit every case alike
            states = [compiler.start(constrained.grammar) if f else None for f in flags]
            params = [constrained if f else plain for f in flags]
            per_step = []
            for s in range(steps):
                t0 = time.perf_counter()
                sample_tokens(logits[s], params, [None] * 8, grammars=states)
                per_step.append(time.perf_counter() - t0)
                for i, st in enumerate(states):
                    if st is not None:
                        st.accept([docs[i][s]])
            times[name].append(statistics.median(per_step))
    base = statistics.median(times["8 plain"])
    print(f"sampler step at batch 8, vocab {vocab}, {steps} steps x {args.repeats} repeats (median of medians), "
          f"{torch.get_num_threads()} torch threads")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"  {name:26s} {m * 1e3:8.3f} ms   x{m / base:5.2f} of plain")


if __name__ == "__main__":
    main()
