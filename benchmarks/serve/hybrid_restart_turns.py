"""Per-turn TTFT of a 10-turn agent-style chat on a Qwen3.5 hybrid, with every server process restarted between
turns 5 and 6, side by side: `edgeserve` (`serve --kv-offload cpu,disk`: state snapshots go to disk with their KV
blocks at shutdown and turn 6 resumes from them), `edgeserve-ram` (no offload: the prefix cache lives in memory
only, so turn 6 recomputes the whole conversation) and, with --llama-server, llama.cpp's llama-server with its best
cache flags (`--cache-reuse 256 --ctx-checkpoints 8 --cache-ram 4096`, one slot).

    python benchmarks/serve/hybrid_restart_turns.py [--model QWEN35.gguf] [--llama-server PATH] [--threads 2]
        [--rewrite-think N] [--no-ram-side]

Without --model it writes a random-weight Qwen3.5-0.8B-shaped Q4_K_M GGUF (edgeserve.bench.random_hybrid_gguf)
with llama.cpp's Qwen3.5 vocabulary (tests/llama_cpp_source.py finds it) under the temp folder and reuses it. Each
turn sends, as /v1/completions text, the history so far in ChatML (previous replies without their <think> part,
as Qwen3.5's template renders them) + a new user message + `<|im_start|>assistant\\n`, one token out, temperature
0, streamed; TTFT is the time to its first chunk. With --rewrite-think N each prompt ends with Qwen3.5's thinking
generation prompt (`<|im_start|>assistant\\n<think>\\n`), the server generates N tokens of "reasoning", and the
client puts the turn back into the history with its <think> block dropped (drop_think), as agents do: the next
prompt then leaves the server's sequence right after the previous user turn. The reply put into the history is a
fixed agent-style text (a random-weight model's own reply would be noise). The sides take turns request by request, so machine drift hits
all alike. Prints one JSON line per turn and side, then a summary: each side's TTFT per turn, the prompt tokens it
computed where it says (edgeserve: /metrics; llama-server: the response's timings), and turn 6's TTFT over
turn 5's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
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
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
        from llama_cpp_source import llama_cpp_dir

        from edgeserve.bench.random_hybrid_gguf import HYBRID_SHAPES, write_random_hybrid

        vocab = llama_cpp_dir() / "models" / "ggml-vocab-qwen35.gguf"
        write_random_hybrid(path.with_suffix(".tmp"), HYBRID_SHAPES["qwen35-0.8b"], "Q4_K_M", vocab, context=32768)
        path.with_suffix(".tmp").rename(path)
    return path


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


THINK_BLOCK = re.compile(r"<think>.*?</think>\n*", re.S)


def drop_think(message: str) -> str:
    """An assistant message as an agent client sends it back: every `<think>...</think>` block and the blank
    lines after it removed (what Qwen3.5's chat template and most agents do with earlier turns' reasoning)."""
    return THINK_BLOCK.sub("", message)


def conversation(turns: int, system_words: int, turn_words: int, seed: int = 0, think: bool = False) -> list[str]:
    """The prompt text of each turn (ChatML). With `think`, each turn's prompt ends with the thinking generation
    prompt (`<|im_start|>assistant\n<think>\n`, the server then generates its reasoning) and the client puts the
    reply back into the history with its <think> block dropped (drop_think), so the next prompt leaves the server's
    sequence inside the previous prompt, right after its user turn; without it the prompt ends at
    `<|im_start|>assistant\n` and the next one extends it."""
    rng, thoughts = random.Random(seed), random.Random(seed + 1)  # the same user turns with or without `think`
    history = f"<|im_start|>system\n{words(rng, system_words)}<|im_end|>\n"
    prompts = []
    for _ in range(turns):
        history += f"<|im_start|>user\n{words(rng, turn_words)}<|im_end|>\n"
        prompts.append(history + "<|im_start|>assistant\n" + ("<think>\n" if think else ""))
        reply = words(rng, turn_words // 2)
        if think:  # what the server computed (its reasoning, then the reply), then what the client sends back
            reply = drop_think(f"<think>\n{words(thoughts, turn_words // 4)}\n</think>\n\n{reply}")
        history += f"<|im_start|>assistant\n{reply}<|im_end|>\n"
    return prompts


def stream_first_token(url: str, body: dict) -> tuple[float, dict]:
    """POST a streamed completion: (seconds to the first chunk with a choice, the last JSON chunk with usage or
    timings in it, else the last one); raises RuntimeError on an HTTP error."""
    import httpx

    t0, first, last = time.perf_counter(), None, {}
    with httpx.stream("POST", url, json=body, timeout=900) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - t0
            last.update({k: v for k, v in chunk.items() if v is not None})
    if first is None:
        raise RuntimeError(f"{url}: no token came back")
    return first, last


class Side:
    """One server process, restartable, asked one completion per turn."""

    def __init__(self, name: str, start) -> None:
        self.name, self._start = name, start
        self.server = start()

    def restart(self) -> None:
        """Stop the process (SIGTERM: edgeserve writes its cache to the disk tier on the way out) and start it again."""
        from edgeserve.bench.servers import stop_server

        stop_server(self.server, timeout=120)
        self.server = self._start()

    def stop(self) -> None:
        from edgeserve.bench.servers import stop_server

        stop_server(self.server)

    def turn(self, text: str, max_tokens: int = 1) -> dict:
        """One turn: TTFT (ms; streamed when `max_tokens` > 1, so the reasoning's decode is not counted), prompt
        tokens, and what the server says it resumed (edgeserve) or computed (llama-server)."""
        from edgeserve.bench.servers import served_model

        ours = self.name != "llama-server"
        model = served_model(self.server.url) if ours else "model"
        before = self._from_states(model) if ours else 0
        body = {"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        ttft, last = stream_first_token(self.server.url + "/v1/completions", body)
        out = {"ttft_ms": round(ttft * 1e3, 1), "prompt": (last.get("usage") or {}).get("prompt_tokens")}
        if ours:
            out["from_states"] = self._from_states(model) - before
        elif isinstance(last.get("timings"), dict):
            out["computed"] = last["timings"].get("prompt_n")
        return out

    def _from_states(self, model: str) -> int:
        """edgeserve's prompt tokens served from state snapshots so far (/metrics)."""
        from edgeserve.bench.servers import http_get

        _, raw = http_get(self.server.url + "/metrics", timeout=30)
        key = f'edgeserve_prompt_tokens_from_states{{model="{model}"}} '
        return int(next((float(line[len(key):]) for line in raw.decode().splitlines() if line.startswith(key)), 0))


def sides(args: argparse.Namespace, model: Path, disk: Path) -> list[Side]:
    """The servers to compare, started."""
    from edgeserve.bench.servers import free_port, start_edgeserve, start_server

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    common = ["--kv-cache-gb", "2", "--max-model-len", "16384"]
    out = [Side("edgeserve", lambda: start_edgeserve(str(model), 1, [*common, "--kv-offload", "cpu,disk",
                                                                       "--disk-kv-path", str(disk)], env=env))]
    if not args.no_ram_side:
        out.append(Side("edgeserve-ram", lambda: start_edgeserve(str(model), 1, common, env=env)))
    if args.llama_server:
        lib = str(Path(args.llama_server).resolve().parent)
        lenv = {**os.environ, "LD_LIBRARY_PATH": lib + os.pathsep + os.environ.get("LD_LIBRARY_PATH", "")}

        def llama():
            port = free_port()
            cmd = [args.llama_server, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "--parallel", "1",
                   "-c", "16384", "-t", str(args.threads), "-tb", str(args.threads), "--no-webui", "--alias", "model",
                   "--cache-reuse", "256", "--ctx-checkpoints", "8", "--cache-ram", "4096"]
            return start_server("llama-server", cmd, port, "/health", 300, lenv)

        out.append(Side("llama-server", llama))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--llama-server", default=None, metavar="PATH")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--restart-after", type=int, default=5)
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--turn-words", type=int, default=80)
    ap.add_argument("--rewrite-think", type=int, default=0, metavar="N",
                    help="each turn the server reasons for N tokens after `<think>` and the client sends the turn "
                         "back with its <think> block dropped, as agents do (0: no reasoning, one token out)")
    ap.add_argument("--no-ram-side", action="store_true", help="leave out the edgeserve side without offload")
    a = ap.parse_args()
    if a.rewrite_think < 0:
        ap.error(f"--rewrite-think must be 0 or more tokens, got {a.rewrite_think}")
    model = a.model or random_model(Path(tempfile.gettempdir()))
    disk = Path(tempfile.mkdtemp(prefix="hybrid-restart-kv-"))
    running = sides(a, model, disk)
    try:
        for s in running:
            s.turn("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")  # loads the model, warms up
        results: dict[str, list[dict]] = {s.name: [] for s in running}
        for i, text in enumerate(conversation(a.turns, a.system_words, a.turn_words, think=a.rewrite_think > 0), 1):
            if i == a.restart_after + 1:
                for s in running:
                    s.restart()
                    s.turn("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")  # the load, out of turn 6
            for s in running:
                r = s.turn(text, max(1, a.rewrite_think))
                results[s.name].append(r)
                print(json.dumps({"turn": i, "side": s.name, **r}), flush=True)
    finally:
        for s in running:
            s.stop()
    k = a.restart_after
    summary = {name: {"ttft_ms": [r["ttft_ms"] for r in rs],
                      "turn_after_restart_over_turn_before": round(rs[k]["ttft_ms"] / rs[k - 1]["ttft_ms"], 2)}
               for name, rs in results.items()}
    print(json.dumps({"model": str(model), "threads": a.threads, "rewrite_think": a.rewrite_think, "summary": summary}))


if __name__ == "__main__":
    main()
