"""Prefix-affinity routing vs Ray's power-of-two choices on `edgeserve cluster`, and the ingress's overhead.

One invocation runs, one after another, on the same model and workload:
  serve   one `edgeserve serve`
  prefix  `edgeserve cluster --replicas 2 --routing prefix`
  pow2    `edgeserve cluster --replicas 2 --routing pow2`
and, to count the cache hits that are possible at all, the workload once more on one `serve` with one request at a
time (every shared block is cached before the next request needs it; at once, requests that share a new prefix
compute it side by side and miss each other).
Workload: 8 conversations, 4 turns each, all 8 running at once; conversation c opens with long system prompt
c % 2 (two prompts, 4 conversations each); every turn adds the previous reply and a new question; greedy, 16 tokens
out (--system-prompts 8: each conversation its own). Per request: TTFT (streamed) and cached prompt tokens
(usage.prompt_tokens_details). Then the ingress overhead: `serve` and a `prefix` cluster up at once, the same short
cached request sent one at a time, alternating between them (TTFT medians).

    python benchmarks/serve/cluster_routing.py [--model smollm2-135m] [--system-prompts 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

WORDS = ("the of and to in is was for on that with as by at from his her an are were which this be has had model "
         "layer state token cache memory server prompt turn reply value weight matrix vector head time").split()
CONVERSATIONS, TURNS, MAX_TOKENS = 8, 4, 16


def system_prompt(i: int, words: int) -> str:
    rng = random.Random(100 + i)
    return f"You are assistant number {i}. " + " ".join(rng.choice(WORDS) for _ in range(words))


def question(c: int, t: int) -> str:
    rng = random.Random(1000 * c + t)
    return f"Question {t} of conversation {c}: " + " ".join(rng.choice(WORDS) for _ in range(25)) + "?"


def stream_chat(url: str, model: str, messages: list[dict]) -> dict:
    """One streamed chat request: its TTFT (s), reply text, prompt and cached tokens, and the replica it hit."""
    body = {"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0, ttft, text, usage = time.perf_counter(), None, [], {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        replica = r.headers.get("x-edgeserve-replica", "-")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(choice["delta"]["content"])
    return {"ttft": ttft or time.perf_counter() - t0, "text": "".join(text), "replica": replica,
            "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)}


def run_workload(url: str, model: str, system_words: int, system_prompts: int, at_once: bool = True) -> list[dict]:
    """The 8 conversations at once (or one after another); each its 4 turns in order."""
    systems = [system_prompt(i, system_words) for i in range(system_prompts)]
    results: list[dict] = []

    def conversation(c: int) -> None:
        messages = [{"role": "system", "content": systems[c % system_prompts]}]
        for t in range(TURNS):
            messages.append({"role": "user", "content": question(c, t)})
            out = stream_chat(url, model, messages)
            messages.append({"role": "assistant", "content": out["text"]})
            results.append({"conversation": c, "turn": t, **{k: v for k, v in out.items() if k != "text"}})

    if not at_once:
        for c in range(CONVERSATIONS):
            conversation(c)
        return results
    threads = [threading.Thread(target=conversation, args=(c,)) for c in range(CONVERSATIONS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return results


def overhead(urls: dict[str, str], model: str, n: int) -> dict[str, list[float]]:
    """TTFT (ms) of the same short request n times per server, one at a time, alternating (cached after the
    first)."""
    msgs = [{"role": "system", "content": system_prompt(99, 60)}, {"role": "user", "content": "Say one word."}]
    for url in urls.values():
        stream_chat(url, model, msgs)
    out: dict[str, list[float]] = {k: [] for k in urls}
    for i in range(n):
        for k in (list(urls) if i % 2 == 0 else list(reversed(urls))):
            out[k].append(stream_chat(urls[k], model, msgs)["ttft"] * 1000)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(kind: str, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "edgeserve", "serve" if kind == "serve" else "cluster", "--model", args.model,
           "--port", str(port), "--kv-cache-gb", str(args.kv_cache_gb), "--keep-alive", "-1",
           "--log-level", "warning"]
    if kind != "serve":
        cmd += ["--replicas", "2", "--num-cpus", "1", "--routing", kind]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # what Ray gives a 1-CPU replica: the same for `serve`
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(f"/tmp/cluster_routing_{kind}.log",
                                                                                    "w"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"{kind} exited; see /tmp/cluster_routing_{kind}.log")
        time.sleep(0.5)
    raise SystemExit(f"{kind} did not start")


def warm(url: str, model: str, replicas: int) -> None:
    """Load the model on every replica, with prompts that share nothing with the workload."""
    seen, i = set(), 0
    while len(seen) < replicas and i < 40:
        seen.add(stream_chat(url, model, [{"role": "user", "content": f"warm-up {i}: " + "zq " * 40}])["replica"])
        i += 1


def summarize(rows: list[dict]) -> dict:
    ttft = sorted(r["ttft"] * 1000 for r in rows)
    later = sorted(r["ttft"] * 1000 for r in rows if r["turn"] > 0)
    return {"requests": len(rows), "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
            "cached_tokens": sum(r["cached_tokens"] for r in rows),
            "ttft_median_ms": statistics.median(ttft), "ttft_p90_ms": ttft[int(0.9 * (len(ttft) - 1))],
            "ttft_turns_2_4_median_ms": statistics.median(later),
            "replicas_per_conversation": statistics.mean(
                len({r["replica"] for r in rows if r["conversation"] == c}) for c in range(CONVERSATIONS))}


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--system-prompts", type=int, default=2, help="distinct system prompts (default %(default)s)")
    p.add_argument("--system-words", type=int, default=500, help="words per system prompt (default %(default)s)")
    p.add_argument("--kv-cache-gb", type=float, default=0.25)
    p.add_argument("--overhead-requests", type=int, default=20, help="per server; 0: skip (default %(default)s)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    out: dict = {"args": vars(args)}
    runs = ("possible", "serve", "prefix", "pow2")
    for kind in runs:
        proc, url = start("serve" if kind == "possible" else kind, args)
        try:
            warm(url, args.model, 2 if kind in ("prefix", "pow2") else 1)
            rows = run_workload(url, args.model, args.system_words, args.system_prompts, at_once=kind != "possible")
            out[kind] = {"summary": summarize(rows), "requests": rows}
            print(kind, json.dumps(out[kind]["summary"]), file=sys.stderr, flush=True)
        finally:
            stop(proc)
    possible = out["possible"]["summary"]["cached_tokens"]
    for kind in runs:
        out[kind]["summary"]["share_of_possible_cached"] = out[kind]["summary"]["cached_tokens"] / max(possible, 1)
    summary = {k: out[k]["summary"] for k in runs}
    if args.overhead_requests:
        procs = [start(kind, args) for kind in ("serve", "prefix")]
        try:
            warm(procs[1][1], args.model, 2)
            ttft = overhead({"serve": procs[0][1], "cluster": procs[1][1]}, args.model, args.overhead_requests)
        finally:
            for proc, _ in procs:
                stop(proc)
        out["overhead_ttft_ms"] = ttft
        summary["overhead"] = {k: statistics.median(v) for k, v in ttft.items()}
        summary["overhead"]["ingress_ms"] = summary["overhead"]["cluster"] - summary["overhead"]["serve"]
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
