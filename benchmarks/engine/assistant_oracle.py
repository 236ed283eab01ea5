"""Gemma 4 assistant speculation's cost on random weights (issue 50): single-stream tokens/s of a Gemma 4 E2B-shape
target with an assistant of the E2B assistant's shape (`--draft`), at forced acceptance 100 / 70 / 40 % against no
speculation, for k = 1..3 drafts per step.

A random assistant never agrees with a random target, so acceptance is forced as in mtp_oracle.py (whose oracle and
timing loop this reuses): the assistant runs every step (its cost is the real one) and AssistantProposer.oracle
(benchmarks only) replaces its drafts with the plain run's greedy continuation, each draft right with probability
`a`. Acceptance on real text is not measured here.

The GGUFs (random, written once under --dir): the target by edgeserve.bench.random_gemma4_gguf (E2B's text stack,
Gemma 4's vocabulary from llama.cpp's models/ggml-vocab-gemma-4.gguf), the assistant by its
write_random_gemma4_assistant (ASSISTANT_SHAPES: 4 blocks of width 256, its heads and MLP width assumed).

    python benchmarks/engine/assistant_oracle.py [--mix Q4_K_M] [--draft-mix Q8_0] [--max-tokens 32] [--ks 1,2,3]
                                                 [--accept 1.0,0.7,0.4] [--rounds 2] [--dir /tmp/g4draft-bench]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from mtp_oracle import measure, oracle_for  # noqa: E402

VOCAB = Path.home() / ".cache/edgeserve/reference/llama.cpp-0.3.36/models/ggml-vocab-gemma-4.gguf"


def write_models(folder: Path, mix: str, draft_mix: str) -> tuple[Path, Path]:
    """(target GGUF, assistant GGUF), written once into `folder`."""
    from edgeserve.bench.random_gemma4_gguf import (ASSISTANT_SHAPES, GEMMA4_SHAPES, write_random_gemma4,
                                                    write_random_gemma4_assistant)

    folder.mkdir(parents=True, exist_ok=True)
    target, draft = folder / f"gemma4-e2b-{mix}.gguf", folder / f"gemma4-e2b-assistant-{draft_mix}.gguf"
    if not target.exists():
        write_random_gemma4(target, GEMMA4_SHAPES["gemma4-e2b"], mix, VOCAB, tile_mb=4)
    if not draft.exists():
        write_random_gemma4_assistant(draft, ASSISTANT_SHAPES["gemma4-e2b-assistant"], GEMMA4_SHAPES["gemma4-e2b"],
                                      draft_mix, VOCAB)
    return target, draft


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mix", default="Q4_K_M")
    ap.add_argument("--draft-mix", default="Q8_0")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--ks", default="1,2,3")
    ap.add_argument("--accept", default="1.0,0.7,0.4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/g4draft-bench")
    a = ap.parse_args()

    from edgeserve import LLM, SamplingParams
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    target_path, draft_path = write_models(Path(a.dir), a.mix, a.draft_mix)
    lm = load_model(resolve(str(target_path)))
    draft = load_model(resolve(str(draft_path)))
    vocab = lm.config.vocab_size
    prompt = [random.Random(1).randrange(1000, 20000) for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    opts = dict(kv_cache_gb=0.25, max_num_seqs=4, enable_prefix_caching=False)
    plain = LLM.from_model(lm, speculative="off", **opts)
    reference = plain.generate([prompt], params)[0].outputs[0].token_ids
    engines = {"plain": plain}
    for k in (int(x) for x in a.ks.split(",")):
        for acc in (float(x) for x in a.accept.split(",")):
            llm = LLM.from_model(lm, draft_model=str(draft_path), draft=draft, num_speculative_tokens=k, **opts)
            llm.engine.spec.draft.oracle = oracle_for(prompt, reference, acc, vocab)
            engines[f"assistant k={k} a={acc:.0%}"] = llm
    measure(engines, prompt, params, reference, a.rounds,
            {"target": f"gemma4-e2b {a.mix}", "assistant": f"gemma4-e2b-assistant {a.draft_mix}"})


if __name__ == "__main__":
    main()
