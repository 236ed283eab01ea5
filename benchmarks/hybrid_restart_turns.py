"""Per-turn TTFT of a 10-turn agent-style chat on a Qwen3.5 hybrid, with the process "restarted" between turns 5
and 6 (the model unloaded and loaded again in a fresh engine over the same --kv-offload disk folder), side by side:
`offload` (--kv-offload cpu,disk: state snapshots go to disk with their KV blocks and turn 6 resumes from them) and
`ram` (the prefix cache in memory only: turn 6 recomputes the whole conversation).

    python benchmarks/hybrid_restart_turns.py [--model QWEN35.gguf] [--turn-words 80] [--system-words 300]

Without --model it writes a random-weight Qwen3.5-0.8B-shaped Q4_K_M GGUF (edgeserve.bench.random_hybrid_gguf)
with llama.cpp's Qwen3.5 vocabulary (tests/llama_cpp_source.py finds it) under the temp folder and reuses it. Each
turn: the history so far in ChatML (the previous replies without their <think> part, as Qwen3.5's template renders
them) + a new user message + `<|im_start|>assistant\\n`, one token out (TTFT: the wall time of that call); the
reply put into the history is a fixed agent-style text (a random-weight model's own reply would be noise). Both
modes run alternately turn by turn, so machine drift hits both alike. Prints one JSON line per turn and a summary:
per-turn TTFT of each mode, prompt tokens, tokens computed, and turn 6's TTFT over turn 5's.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("the of and to in is was for on that with as by at from file line tool call result error test function "
         "model layer state token cache memory server prompt turn reply value weight matrix vector head time").split()


def random_model(folder: Path) -> Path:
    """The random Qwen3.5-0.8B-shaped GGUF (written once)."""
    path = folder / "qwen35-0.8b-random-q4km.gguf"
    if not path.exists():
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from llama_cpp_source import llama_cpp_dir

        from edgeserve.bench.random_hybrid_gguf import HYBRID_SHAPES, write_random_hybrid

        vocab = llama_cpp_dir() / "models" / "ggml-vocab-qwen35.gguf"
        write_random_hybrid(path.with_suffix(".tmp"), HYBRID_SHAPES["qwen35-0.8b"], "Q4_K_M", vocab, context=32768)
        path.with_suffix(".tmp").rename(path)
    return path


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def conversation(turns: int, system_words: int, turn_words: int, seed: int = 0) -> list[str]:
    """The prompt text of each turn (ChatML)."""
    rng = random.Random(seed)
    history = f"<|im_start|>system\n{words(rng, system_words)}<|im_end|>\n"
    prompts = []
    for _ in range(turns):
        history += f"<|im_start|>user\n{words(rng, turn_words)}<|im_end|>\n"
        prompts.append(history + "<|im_start|>assistant\n")
        # the reply as the next turn's prompt holds it: its <think> dropped (it was never computed: one token out)
        history += f"<|im_start|>assistant\n{words(rng, turn_words // 2)}<|im_end|>\n"
    return prompts


class Mode:
    """One side: an LLM over the model with its engine options, restartable."""

    def __init__(self, name: str, model: Path, **options) -> None:
        self.name, self.model, self.options = name, model, options
        self.llm = self._load()

    def _load(self):
        from edgeserve import LLM

        return LLM(str(self.model), kv_cache_gb=1.0, **self.options)

    def restart(self) -> None:
        """What a server restart (or an unload and load) does: close the engine, load a fresh one."""
        self.llm.close()
        self.llm = self._load()

    def turn(self, text: str) -> dict:
        from edgeserve import SamplingParams

        ids = self.llm.tokenizer.encode(text)
        before = self.llm.engine.stats()
        t0 = time.perf_counter()
        self.llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        ttft = time.perf_counter() - t0
        after = self.llm.engine.stats()
        return {"ttft_ms": round(ttft * 1e3, 1), "prompt": len(ids),
                "computed": after.prompt_tokens_computed - before.prompt_tokens_computed,
                "from_states": after.prompt_tokens_from_states - before.prompt_tokens_from_states}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--restart-after", type=int, default=5)
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--turn-words", type=int, default=80)
    a = ap.parse_args()
    model = a.model or random_model(Path(tempfile.gettempdir()))
    disk = Path(tempfile.mkdtemp(prefix="hybrid-restart-kv-"))
    modes = [Mode("offload", model, kv_offload="cpu,disk", disk_kv_path=str(disk)), Mode("ram", model)]
    warm = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    for m in modes:
        m.turn(warm)  # one-time start-up costs out of turn 1
    results: dict[str, list[dict]] = {m.name: [] for m in modes}
    for i, text in enumerate(conversation(a.turns, a.system_words, a.turn_words), 1):
        if i == a.restart_after + 1:
            for m in modes:
                m.restart()
        for m in modes:
            r = m.turn(text)
            results[m.name].append(r)
            print(json.dumps({"turn": i, "mode": m.name, **r}), flush=True)
    k = a.restart_after
    summary = {name: {"ttft_ms": [r["ttft_ms"] for r in rs], "computed": [r["computed"] for r in rs],
                      "turn_after_restart_over_turn_before": round(rs[k]["ttft_ms"] / rs[k - 1]["ttft_ms"], 2)}
               for name, rs in results.items()}
    summary["turn_after_restart_ram_over_offload"] = round(
        results["ram"][k]["ttft_ms"] / results["offload"][k]["ttft_ms"], 2)
    print(json.dumps({"model": str(model), "summary": summary}))


if __name__ == "__main__":
    main()
