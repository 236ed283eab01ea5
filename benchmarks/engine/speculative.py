"""Speculative decoding: generated tokens/s with and without it, copy-heavy vs open-ended prompts, batch 1 and 8.

One process, the same loaded model for every side; sides alternate within each round so machine drift hits
them all; reports medians, ratios to the plain side and acceptance. Greedy, end of turn honoured (the copy
answer ends by itself); tokens/s = tokens generated / wall time of `generate` (prefill included, prefix cache
off).

    python benchmarks/engine/speculative.py [--rounds 3] [--max-tokens 64] [--batch 8] [--draft-pair]

--draft-pair adds the int4 default model as draft for the same GGUF at float32 (target) at batch 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

CODE = '''def merge_sorted(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]'''

COPY = f"Rename the function merge_sorted to merge in this code and output the whole code:\n\n{CODE}"
CHAT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
TOPICS = ["the sea", "a clock", "bread", "winter", "a violin", "rivers", "chess", "bees"]


def _parse_args() -> argparse.Namespace:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--draft-pair", action="store_true")
    ap.add_argument("--model", default="smollm2-135m")
    return ap.parse_args()


def main() -> None:
    a = _parse_args()

    from edgeserve import LLM, SamplingParams
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    lm = load_model(resolve(a.model))

    def chat(llm_lm, text: str) -> list[int]:
        return llm_lm.tokenizer.encode(llm_lm.chat_template.render([{"role": "user", "content": text}]),
                                       add_special_tokens=False)

    opts = dict(kv_cache_gb=0.5, max_num_seqs=max(a.batch, 1), enable_prefix_caching=False)
    engines = {"plain": LLM.from_model(lm, **opts),
               "ngram": LLM.from_model(lm, speculative="ngram", num_speculative_tokens=a.k, **opts)}
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    workloads = {
        "copy b1": [chat(lm, COPY)],
        "chat b1": [chat(lm, CHAT)],
        f"copy b{a.batch}": [chat(lm, COPY.replace("merge_sorted to merge", f"merge_sorted to merge_{i}"))
                             for i in range(a.batch)],
        f"chat b{a.batch}": [chat(lm, f"Write a short story about {TOPICS[i % 8]}.") for i in range(a.batch)],
    }
    cases = [(w, side) for w in workloads for side in engines]
    if a.draft_pair:
        fp32 = load_model(resolve(a.model), dtype="float32")
        engines["fp32 plain"] = LLM.from_model(fp32, **opts)
        engines["fp32 + int4 draft"] = LLM.from_model(fp32, speculative="draft", num_speculative_tokens=a.k,
                                                      draft=lm, **opts)
        cases += [(w, side) for w in ("copy b1", "chat b1") for side in ("fp32 plain", "fp32 + int4 draft")]
    rates: dict = {c: [] for c in cases}
    accept: dict = {}
    for _ in range(a.rounds):
        for w, side in cases:
            llm = engines[side]
            before = llm.engine.stats()
            start = time.perf_counter()
            out = llm.generate(workloads[w], params)
            dt = time.perf_counter() - start
            n = sum(len(r.outputs[0].token_ids) for r in out)
            rates[(w, side)].append(n / dt)
            after = llm.engine.stats()
            prop = after.spec_proposed_tokens - before.spec_proposed_tokens
            acc = after.spec_accepted_tokens - before.spec_accepted_tokens
            ver = after.spec_verifications - before.spec_verifications
            if prop:
                accept[(w, side)] = (acc / prop, 1 + acc / max(ver, 1), n)
            print(f"# {w} / {side}: {n} tokens in {dt:.2f}s = {n / dt:.1f} tok/s", flush=True)
    for w, side in cases:
        base = statistics.median(rates[(w, "fp32 plain" if side.startswith("fp32") else "plain")])
        med = statistics.median(rates[(w, side)])
        ar = accept.get((w, side))
        print(json.dumps({"workload": w, "side": side, "median_tok_s": round(med, 1),
                          "rounds": [round(r, 1) for r in rates[(w, side)]], "ratio": round(med / base, 2),
                          "acceptance": round(ar[0], 2) if ar else None,
                          "tokens_per_verification": round(ar[1], 2) if ar else None,
                          "tokens": ar[2] if ar else None}))


if __name__ == "__main__":
    main()
