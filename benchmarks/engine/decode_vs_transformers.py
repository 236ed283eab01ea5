"""Single-stream greedy decode tokens/s: edgeserve vs transformers' generate(), same GGUF, same prompt.

Runs alternate A/B/C in one process so machine drift hits all sides alike; reports medians.
Decode rate for every side is (N - 1) / (time to N tokens - time to 1 token), prefill excluded.

    python benchmarks/engine/decode_vs_transformers.py [--tokens 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()

    import transformers

    from edgeserve.llm import LLM
    from edgeserve.models.load import load_model
    from edgeserve.registry import DEFAULT_MODEL, resolve
    from edgeserve.sampling_params import SamplingParams

    src = resolve(DEFAULT_MODEL)
    ours = {d: LLM.from_model(load_model(src, dtype=d), kv_cache_gb=0.1) for d in ("auto", "float32")}
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(src.path.parent), gguf_file=src.path.name,
                                                            dtype=torch.float32).eval()
    lm = ours["float32"].lm
    prompt = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]
    ids = lm.tokenizer.encode(lm.chat_template.render(prompt), add_special_tokens=False)

    def time_ours(model, n: int) -> float:
        start = time.perf_counter()
        out = model.generate([ids], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0]
        assert len(out.outputs[0].token_ids) == n
        return time.perf_counter() - start

    def time_hf(n: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            ref.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - start

    sides = {
        "edgeserve (bf16, 4-bit packed)": lambda n: time_ours(ours["auto"], n),
        "edgeserve (float32)": lambda n: time_ours(ours["float32"], n),
        "transformers generate (float32)": time_hf,
    }
    rates: dict[str, list[float]] = {k: [] for k in sides}
    for f in sides.values():  # warm-up
        f(4)
    for _ in range(a.rounds):
        for name, f in sides.items():
            t1, tn = f(1), f(a.tokens)
            rates[name].append((a.tokens - 1) / (tn - t1))
    base = statistics.median(rates["transformers generate (float32)"])
    out = {name: {"median_tok_s": round(statistics.median(r), 1), "ratio_vs_transformers": round(statistics.median(r) / base, 2),
                  "runs": [round(x, 1) for x in r]} for name, r in rates.items()}
    print(json.dumps({"prompt_tokens": len(ids), "new_tokens": a.tokens, "torch_threads": torch.get_num_threads(),
                      "results": out}, indent=2))


if __name__ == "__main__":
    main()
