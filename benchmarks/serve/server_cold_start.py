"""Cold start and warm TTFT of `edgeserve serve` on one model, each run in a fresh server process.

    python benchmarks/serve/server_cold_start.py --runs 3 --warm 5

Cold start: from spawning `edgeserve serve` (model not loaded) to the first streamed token of a chat request
sent as soon as /health answers. Warm TTFT: request sent to first streamed token, model loaded, the same short
chat prompt each time (so its prefix is cached after the first), greedy, medians over --warm requests.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_token_seconds(url: str, model: str, prompt: str) -> float:
    """Send a streaming chat request; seconds until the first chunk with content (the rest is then read)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4,
                       "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                choices = json.loads(line[5:])["choices"]
                if choices and choices[0]["delta"].get("content"):
                    dt = time.perf_counter() - t0
                    r.read()
                    return dt
    raise RuntimeError("no token came back")


def one_run(model: str, warm: int) -> tuple[float, list[float]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "edgeserve", "serve", "--model", model, "--port", str(port),
                             "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=1).read()
                break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError("server exited")
                time.sleep(0.02)
        ready = time.perf_counter() - t0
        ttft_cold = first_token_seconds(url, model, "Hello! Who are you?")
        cold = ready + ttft_cold  # spawn -> /health answers -> request sent at once -> first token
        print(f"  server answering /health after {ready:.2f}s; first request's TTFT {ttft_cold:.2f}s; "
              f"cold start {cold:.2f}s", flush=True)
        warms = [first_token_seconds(url, model, "Hello! Who are you?") for _ in range(warm)]
        print("  warm TTFT: " + ", ".join(f"{w * 1000:.0f} ms" for w in warms), flush=True)
        return cold, warms
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warm", type=int, default=5)
    args = ap.parse_args()
    colds, warms = [], []
    for i in range(args.runs):
        print(f"run {i + 1}:", flush=True)
        cold, w = one_run(args.model, args.warm)
        colds.append(cold)
        warms.append(statistics.median(w))
    print(f"cold start (spawn -> first token), median of {args.runs}: {statistics.median(colds):.2f}s "
          f"(runs: {', '.join(f'{c:.2f}' for c in colds)})")
    print(f"warm TTFT, median of the runs' medians: {statistics.median(warms) * 1000:.0f} ms "
          f"(runs: {', '.join(f'{w * 1000:.0f}' for w in warms)})")
    print(f"load average: {os.getloadavg()}")


if __name__ == "__main__":
    main()
