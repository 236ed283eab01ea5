"""MTP speculation's cost on random weights (issue 50): single-stream tokens/s with the MTP head at forced acceptance
100 / 70 / 40 % against no speculation, for k = 1..4 drafts per step.

Random weights make a head that never agrees with its trunk, so acceptance is forced: the proposer is the model's
MTP head (it runs every step, so its cost is the real one) and an oracle (MtpProposer.oracle, for benchmarks only)
replaces its drafts with the target's own greedy continuation from a plain run, each draft kept right with
probability `a` (the first wrong one ends what can be accepted), the counts drawn from an evenly spread sequence
(`oracle_for`; `--random-draws`: independent draws, as before 2026-12-03 evening). Acceptance on real text is not
measured here.

The GGUF: a random Qwen3.5 shape (edgeserve.bench.random_hybrid_gguf) with one MTP block and the real Qwen3.5
vocabulary (llama.cpp's models/ggml-vocab-qwen35.gguf), written once into the cache folder. One process, the same
loaded model for every side; sides alternate within each round; reports medians and ratios to the plain side.
tokens/s = generated tokens / wall time of `generate` (a short prompt: prefill included).

    python benchmarks/engine/mtp_oracle.py [--shape qwen35-0.8b] [--mix Q4_K_M] [--max-tokens 48] [--ks 1,2,3,4]
                                    [--accept 1.0,0.7,0.4] [--rounds 2] [--layers N] [--backoff 0.3]
                                    [--draft-vocab 0,32768] [--per-op-head 0.7] [--no-replay 0.7] [--out /tmp/folder]
                                    [--random-draws]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import random
import statistics
import time
from pathlib import Path

VOCAB = Path.home() / ".cache/edgeserve/reference/llama.cpp-0.3.36/models/ggml-vocab-qwen35.gguf"


GOLDEN = (5 ** 0.5 - 1) / 2  # the golden ratio's fraction: the most evenly spread sequence of draws


def oracle_for(prompt: list[int], reference: list[int], accept: float, vocab: int, seed: int = 0,
               even: bool = True):
    """MtpProposer.oracle proposing `reference` (the plain run's output for `prompt`), each draft right with
    probability `accept` until the first wrong one: a verification's count of right drafts is m with probability
    accept**m (1 - accept) (m < k). `even`: the counts from a low-discrepancy sequence of draws (u_n = frac(0.5 +
    n golden), m = the largest m <= k with u_n < accept**m), so a run of a few dozen verifications already has
    the distribution's mean and sides and rounds compare the same pattern; else independent random draws."""
    rng, draws = random.Random(seed), itertools.count()

    def oracle(seq, drafts: list[int]) -> list[int]:
        done = len(seq.all_token_ids) - len(prompt)
        future = reference[done: done + len(drafts)]
        if not even:
            return [t if rng.random() < accept else (t + 1) % vocab for t in future] or drafts
        u, right = (0.5 + next(draws) * GOLDEN) % 1.0, 0
        while right < len(future) and u < accept ** (right + 1):
            right += 1
        return [t if i < right else (t + 1) % vocab for i, t in enumerate(future)] or drafts

    return oracle


def _parse_args() -> argparse.Namespace:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen35-0.8b")
    ap.add_argument("--mix", default="Q4_K_M")
    ap.add_argument("--layers", type=int, default=None, help="fewer trunk layers (a quicker, smaller model)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--accept", default="1.0,0.7,0.4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--backoff", type=float, default=None,
                    help="also this acceptance with the back-off policy on (it is off for the other sides)")
    ap.add_argument("--vocab", default=str(VOCAB), help="a GGUF whose tokenizer the model takes")
    ap.add_argument("--draft-vocab", default="32768",
                    help="comma-separated --spec-draft-vocab values, one set of sides each (0: the whole vocabulary)")
    ap.add_argument("--kv-gb", type=float, default=0.25, help="each side's KV budget (every side holds its own)")
    ap.add_argument("--per-op-head", default=None, type=float,
                    help="also this acceptance with the head's block per-op (its fused one-layer plan set aside)")
    ap.add_argument("--no-replay", default=None,
                    help="also these acceptances (comma-separated) with the hybrid's state backup / restore and "
                         "recompute instead of drafts kept off the states (Engine.set_draft_replay(False))")
    ap.add_argument("--out", default=None, help="also write the GGUF here (default: the edgeserve cache folder)")
    ap.add_argument("--random-draws", action="store_true",
                    help="each draft's fate an independent random draw (default: evenly spread counts)")
    return ap.parse_args()


def main() -> None:
    a = _parse_args()

    from edgeserve import LLM
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    path = write_model(a.shape, a.mix, a.layers, Path(a.vocab), Path(a.out) if a.out else None)
    lm = load_model(resolve(str(path)))
    vocab = lm.config.vocab_size
    opts = dict(kv_cache_gb=a.kv_gb, max_num_seqs=1, enable_prefix_caching=False)  # one stream
    prompt, params, plain, reference = plain_run(lm, a.max_tokens, opts)
    engines = {"plain": plain}
    for dv in (int(x) for x in a.draft_vocab.split(",")):
        for k in (int(x) for x in a.ks.split(",")):
            for acc in (float(x) for x in a.accept.split(",")):
                llm = LLM.from_model(lm, speculative="mtp", num_speculative_tokens=k, spec_draft_vocab=dv, **opts)
                llm.engine.spec.mtp.oracle = oracle_for(prompt, reference, acc, vocab, even=not a.random_draws)
                llm.engine.spec.backoff = None  # the raw cost at this acceptance
                engines[f"mtp dv={dv} k={k} a={acc:.0%}"] = llm
            for acc in (float(x) for x in (a.no_replay.split(",") if a.no_replay else [])):
                llm = LLM.from_model(lm, speculative="mtp", num_speculative_tokens=k, spec_draft_vocab=dv, **opts)
                llm.engine.spec.mtp.oracle = oracle_for(prompt, reference, acc, vocab, even=not a.random_draws)
                llm.engine.spec.backoff = None
                llm.engine.set_draft_replay(False)
                engines[f"mtp dv={dv} k={k} a={acc:.0%} no replay"] = llm
            if a.per_op_head is not None:  # the same with the head's block per-op
                llm = LLM.from_model(lm, speculative="mtp", num_speculative_tokens=k, spec_draft_vocab=dv, **opts)
                llm.engine.spec.mtp.oracle = oracle_for(prompt, reference, a.per_op_head, vocab,
                                                        even=not a.random_draws)
                llm.engine.spec.backoff = None
                engines[f"mtp dv={dv} k={k} a={a.per_op_head:.0%} per-op head"] = PerOpHead(llm, lm.model.mtp)
            if a.backoff is not None:  # the same with the back-off policy on
                llm = LLM.from_model(lm, speculative="mtp", num_speculative_tokens=k, spec_draft_vocab=dv, **opts)
                llm.engine.spec.mtp.oracle = oracle_for(prompt, reference, a.backoff, vocab, even=not a.random_draws)
                engines[f"mtp dv={dv} k={k} a={a.backoff:.0%} backoff"] = llm
    measure(engines, prompt, params, reference, a.rounds, {"shape": a.shape, "layers": a.layers, "mix": a.mix})


def plain_run(lm, max_tokens: int, opts: dict):
    """The benchmarks' 8-token prompt, greedy `max_tokens` params, a plain (speculation off) LLM over `lm` with engine
    options `opts`, and its output for the prompt (the reference every side must give)."""
    from edgeserve import LLM, SamplingParams

    prompt = [random.Random(1).randrange(1000, 20000) for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    plain = LLM.from_model(lm, speculative="off", **opts)
    return prompt, params, plain, plain.generate([prompt], params)[0].outputs[0].token_ids


class PerOpHead:
    """An LLM whose MTP head runs its block per-op during `generate` (the head's fused plan set aside, then put
    back), beside sides that run it fused."""

    def __init__(self, llm, head) -> None:
        self.llm, self.head, self.engine = llm, head, llm.engine

    def generate(self, *args, **kwargs):
        fused, self.head.native = self.head.native, None
        try:
            return self.llm.generate(*args, **kwargs)
        finally:
            self.head.native = fused


def measure(engines: dict, prompt: list[int], params, reference: list[int], rounds: int, label: dict) -> None:
    """Generate `prompt` on each side (`engines`: name -> LLM, "plain" among them) `rounds` times, sides alternating,
    checking each output is `reference`; print each run, then one JSON line per side (`label`'s keys first): median
    tokens per wall second and per CPU second, their ratios to plain's, acceptance and tokens per verification."""
    rates, cpu = run_rounds(engines, prompt, params, reference, rounds)
    base, cpu_base = statistics.median(rates["plain"][0]), statistics.median(cpu["plain"])
    for side, (r, s) in rates.items():
        med, cmed = statistics.median(r), statistics.median(cpu[side])
        print(json.dumps({**label, "side": side,
                          "median_tok_s": round(med, 2), "rounds": [round(x, 2) for x in r],
                          "ratio": round(med / base, 2), "median_cpu_tok_s": round(cmed, 2),
                          "cpu_rounds": [round(x, 2) for x in cpu[side]], "cpu_ratio": round(cmed / cpu_base, 2),
                          "acceptance": round(s[0], 2) if s else None,
                          "tokens_per_verification": round(s[1], 2) if s else None}))


def run_rounds(engines: dict, prompt: list[int], params, reference: list[int], rounds: int):
    """Per side: (tokens / wall second per round, its (acceptance, tokens per verification) or None), and tokens
    per CPU second of this process per round (steadier than wall time on a shared machine: another job's turn on
    the core is not counted; with one thread it is the work a token costs). Sides alternate within each round."""
    rates: dict[str, tuple[list[float], tuple[float, float] | None]] = {side: ([], None) for side in engines}
    cpu: dict[str, list[float]] = {side: [] for side in engines}
    for _ in range(rounds):
        for side, llm in engines.items():
            before = llm.engine.stats()
            start, cpu_start = time.perf_counter(), time.process_time()
            out = llm.generate([prompt], params)[0].outputs[0].token_ids
            dt, cpu_dt = time.perf_counter() - start, time.process_time() - cpu_start
            assert out == reference, f"{side}: greedy output differs from the plain run's"
            rates[side][0].append(len(out) / dt)
            cpu[side].append(len(out) / cpu_dt)
            after = llm.engine.stats()
            prop = after.spec_proposed_tokens - before.spec_proposed_tokens
            if prop:
                acc = after.spec_accepted_tokens - before.spec_accepted_tokens
                ver = after.spec_verifications - before.spec_verifications
                rates[side] = (rates[side][0], (acc / prop, 1 + acc / max(ver, 1)))
            print(f"# {side}: {len(out)} tokens in {dt:.2f}s ({cpu_dt:.2f} CPU s) = {len(out) / dt:.1f} tok/s",
                  flush=True)
    return rates, cpu


def write_model(shape_name: str, mix: str, layers: int | None, vocab: Path = VOCAB, folder: Path | None = None) -> Path:
    """The random GGUF of `shape_name` with one MTP block and the Qwen3.5 vocabulary (written once into `folder`,
    default the cache folder's bench/)."""
    from edgeserve.bench.random_hybrid_gguf import HYBRID_SHAPES, write_random_hybrid
    from edgeserve.registry.paths import edgeserve_home

    shape = dataclasses.replace(HYBRID_SHAPES[shape_name], mtp_layers=1)
    if layers:
        shape = dataclasses.replace(shape, layers=layers)
    path = (folder or edgeserve_home() / "bench") / f"{shape_name}{f'-{layers}l' if layers else ''}-mtp-{mix}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_random_hybrid(path, shape, mix, vocab)
    return path


if __name__ == "__main__":
    main()
