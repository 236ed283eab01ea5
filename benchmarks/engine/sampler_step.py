"""The sampler's cost per decode step at batch 8 over the default model's vocabulary (49,152), side by side with
another version of edgeserve/engine/runner/sampler.py, interleaved, medians and ratios.

    git show 70d481f:edgeserve/engine/sampler.py > /tmp/sampler_before.py  # (engine/runner/sampler.py since the wings)
    python benchmarks/engine/sampler_step.py --other /tmp/sampler_before.py [--end-to-end]

Logits are the default model's own, for 8 different prompts, so the distributions' widths are realistic.
`--end-to-end` also times whole generations (8 prompts together, 64 sampled tokens each, temperature 0.7,
top_p 0.9) through the engine with each sampler in turn: output tokens/s, medians and the ratio.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch

from edgeserve.engine.runner import sampler as current
from edgeserve.sampling_params import SamplingParams

CASES = {
    "temperature 0.7, top_p 0.9": dict(temperature=0.7, top_p=0.9),
    "temperature 1.0 only": dict(temperature=1.0),
    "temperature 0.8, top_k 40": dict(temperature=0.8, top_k=40),
    "greedy": dict(temperature=0.0),
}


def _load(path: str):
    spec = importlib.util.spec_from_file_location("sampler_other", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _logits(batch: int) -> torch.Tensor:
    """The default model's logits for the first generated token of `batch` different prompts."""
    from edgeserve.engine.runner import sampler as model_sampler
    from edgeserve.llm import LLM

    captured = []
    original = model_sampler.sample_tokens

    def capture(logits, *args, **kwargs):
        captured.append(logits.float().clone())
        return original(logits, *args, **kwargs)

    model_sampler.sample_tokens = capture
    try:
        llm = LLM(max_num_seqs=batch, kv_cache_gb=0.1)
        llm.generate([f"Story {i}: once upon a time there was a" for i in range(batch)],
                     SamplingParams(temperature=0, max_tokens=1))
    finally:
        model_sampler.sample_tokens = original
    return torch.cat(captured)[:batch]


def _end_to_end(other, rounds: int, batch: int) -> None:
    from edgeserve.engine.runner import sampler as model_sampler
    from edgeserve.llm import LLM

    llm = LLM(max_num_seqs=batch, kv_cache_gb=0.2)
    prompts = [f"Write a story about a {w}." for w in ("cat", "ship", "clock", "tree", "city", "robot", "river",
                                                         "violin")][:batch]
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=64, ignore_eos=True, seed=1)
    llm.generate(prompts, params)  # warm-up
    rates = {"other": [], "current": []}
    original = model_sampler.sample_tokens
    try:
        for _ in range(rounds):
            for label, module in (("other", other), ("current", current)):
                model_sampler.sample_tokens = module.sample_tokens
                start = time.perf_counter()
                results = llm.generate(prompts, params)
                tokens = sum(len(r.outputs[0].token_ids) for r in results)
                rates[label].append(tokens / (time.perf_counter() - start))
    finally:
        model_sampler.sample_tokens = original
    a, b = statistics.median(rates["other"]), statistics.median(rates["current"])
    print(f"end to end, {batch} sampled requests together: other {a:.1f}, current {b:.1f} output tokens/s "
          f"({b / a:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", required=True, help="path to another sampler.py to compare with")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--end-to-end", action="store_true", help="also time whole sampled generations")
    args = parser.parse_args()
    other = _load(args.other)
    logits = _logits(args.batch)
    print(f"batch {args.batch}, vocab {logits.shape[1]}, {args.rounds} rounds of {args.steps} steps; ms per step")
    print(f"{'case':32} {'other':>8} {'current':>8} {'ratio':>7}")
    for name, kwargs in CASES.items():
        params = [SamplingParams(seed=i, **kwargs) for i in range(args.batch)]
        times = {"other": [], "current": []}
        for _ in range(args.rounds):
            for label, module in (("other", other), ("current", current)):
                gens = [module.make_generator(p) for p in params]
                start = time.perf_counter()
                for _ in range(args.steps):
                    module.sample_tokens(logits, params, gens)
                times[label].append((time.perf_counter() - start) / args.steps * 1000)
        a, b = statistics.median(times["other"]), statistics.median(times["current"])
        print(f"{name:32} {a:8.2f} {b:8.2f} {a / b:6.2f}x")
    if args.end_to_end:
        _end_to_end(other, max(3, args.rounds // 2), args.batch)


if __name__ == "__main__":
    main()
