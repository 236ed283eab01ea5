"""Image encode time and one-image TTFT, edgeserve vs llama-server (--mmproj), same GGUF + mmproj files.

    python benchmarks/serve/vision_ttft.py --model LM.gguf --mmproj MMPROJ.gguf --llama-server PATH --rounds 3

Both servers up at once (2 threads each), one request at a time, order alternating per round. Each round sends a
new random SIZE x SIZE PNG (so no encoder or prefix cache helps) in an OpenAI chat request with a short text,
streamed, max_tokens 1, greedy; TTFT is the time to the first streamed token. Then a text-only prompt of as many
tokens as that image prompt (random ids on /v1/completions, so no cache helps either) gives the TTFT without the
image; the difference is the image's cost (its encoding, as llama-server reports no encoder time), measured the
same way on both. edgeserve's own encoder time (`edgeserve_image_encode_seconds`, /metrics) is reported beside.
Prints one JSON object (every sample, medians, ratios edgeserve / llama-server)."""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from edgeserve.bench.servers import free_port, start_edgeserve, start_server, stop_all


def picture(size: int, seed: int) -> str:
    """A random smooth-plus-noise RGB PNG as a data URL."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size]
    arr = np.stack([xx * 255 / size, yy * 255 / size, (xx ^ yy) % 255], -1) + rng.normal(0, 40, (size, size, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def ttft(url: str, model: str, image: str | None = None, prompt_ids: list[int] | None = None,
         native: bool = False) -> float:
    """Seconds from sending the request (a chat turn with `image`, or a completion of `prompt_ids`) to the first
    streamed token; `native`: llama-server's own /completion (its /v1/completions takes no token ids)."""
    body: dict = {"model": model, "stream": True, "max_tokens": 1, "temperature": 0}
    if image is not None:
        body["messages"] = [{"role": "user", "content": [{"type": "text", "text": "Describe this picture."},
                                                         {"type": "image_url", "image_url": {"url": image}}]}]
        route = "/v1/chat/completions"
    else:
        body["prompt"], route = prompt_ids, "/completion" if native else "/v1/completions"
        if native:
            body["n_predict"] = 1
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}{route}", json=body, timeout=900) as r:
        if r.status_code != 200:
            raise SystemExit(f"{url}: HTTP {r.status_code}: {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("content") or any(c.get("delta", {}).get("content") or c.get("text")
                                               for c in chunk.get("choices", [])):
                    return time.perf_counter() - t0
    return time.perf_counter() - t0


def encode_seconds_counter(url: str) -> float:
    """edgeserve's total vision-encoder seconds (all models)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("edgeserve_image_encode_seconds_total"))


def prompt_tokens(url: str, model: str, image: str) -> int:
    """The prompt tokens of the image request (its usage), so the text-only prompt matches its length."""
    body = {"model": model, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Describe this picture."},
                                                      {"type": "image_url", "image_url": {"url": image}}]}]}
    return int(httpx.post(f"{url}/v1/chat/completions", json=body, timeout=900).json()["usage"]["prompt_tokens"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--mmproj", required=True)
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--logs", type=Path, default=Path("/tmp/vision_ttft"))
    args = ap.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    lp = free_port()
    llama = start_server("llama.cpp", [args.llama_server, "-m", args.model, "--mmproj", args.mmproj, "--host",
                                       "127.0.0.1", "--port", str(lp), "-t", "2", "-tb", "2", "-c", "8192",
                                       "--parallel", "1", "--no-webui"], lp, log_dir=args.logs)
    ours = start_edgeserve(args.model, 4, ["--mmproj", args.mmproj], env=dict(os.environ, OMP_NUM_THREADS="2"),
                           log_dir=str(args.logs))
    servers = {"edgeserve": ours.url, "llama.cpp": llama.url}
    keys = ("ttft_s", "text_ttft_s", "image_cost_s")
    samples: dict[str, dict[str, list[float]]] = {k: {key: [] for key in keys} for k in servers}
    samples["edgeserve"]["encoder_s"] = []
    try:
        # the first request loads edgeserve's model; both count the image prompt's tokens the same way
        lengths = {name: prompt_tokens(url, args.model, picture(args.size, 10_000)) for name, url in servers.items()}
        rng = np.random.default_rng(1)
        for r in range(args.rounds):
            order = list(servers) if r % 2 == 0 else list(reversed(servers))
            for name in order:
                url, image = servers[name], picture(args.size, 2 * r + (name == "llama.cpp"))
                before = encode_seconds_counter(url) if name == "edgeserve" else 0.0
                s = samples[name]
                s["ttft_s"].append(ttft(url, args.model, image))
                if name == "edgeserve":
                    s["encoder_s"].append(encode_seconds_counter(url) - before)
                ids = rng.integers(1000, 40000, lengths[name]).tolist()  # ordinary text tokens of any vocabulary here
                s["text_ttft_s"].append(ttft(url, args.model, prompt_ids=ids, native=name == "llama.cpp"))
                s["image_cost_s"].append(s["ttft_s"][-1] - s["text_ttft_s"][-1])
                print(name, {k: round(v[-1], 3) for k, v in s.items()}, file=sys.stderr, flush=True)
    finally:
        stop_all()
    medians = {n: {k: statistics.median(v) for k, v in s.items()} for n, s in samples.items()}
    ratios = {k: medians["edgeserve"][k] / medians["llama.cpp"][k] for k in keys}
    print(json.dumps({"size": args.size, "rounds": args.rounds, "prompt_tokens": lengths, "samples": samples,
                      "medians": medians,
                      "ratio_edgeserve_over_llama": ratios}, indent=1))


if __name__ == "__main__":
    main()
