"""Decode pace of a running stream while another request's image is encoded (issue 35: within 1.5x of unloaded).

    python benchmarks/serve/vision_interference.py --model LM.gguf --mmproj MMPROJ.gguf [--rounds 2] [--tokens 400]

One edgeserve server (2 threads). Each round: a text stream (greedy, `ignore_eos`, --tokens output tokens) alone,
then the same stream with an image request (a new random SIZE x SIZE PNG, so nothing is cached) sent once it has
produced 20 tokens. The stream's inter-token gaps are split into those while the image request was in its
encoding (from its send until its first token) and the rest; reported: the median gap unloaded, during the encode
and their ratio (medians over rounds), and the image request's TTFT. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import threading
import time

import httpx
import numpy as np
from PIL import Image

from edgeserve.bench.servers import start_edgeserve, stop_all


def _png(size: int, seed: int) -> str:
    img = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _stream(url: str, model: str, tokens: int, times: list[float], started: threading.Event | None = None) -> None:
    """A greedy text stream; the arrival time of each content chunk is appended to `times`."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=3600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                times.append(time.perf_counter())
                if started is not None and len(times) == 20:
                    started.set()


def _image_request(url: str, model: str, size: int, seed: int) -> tuple[float, float]:
    """(send time, first-token time) of a one-image chat request."""
    body = {"model": model, "max_tokens": 1, "temperature": 0, "stream": True, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": _png(size, seed)}}]}]}
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=3600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                return t0, time.perf_counter()
    raise RuntimeError("the image request gave no token")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--mmproj", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=400, help="the loaded stream's length (it must outlast the encode)")
    ap.add_argument("--alone-tokens", type=int, default=200, help="the unloaded stream's length")
    ap.add_argument("--size", type=int, default=512)
    a = ap.parse_args()
    server = start_edgeserve(a.model, extra_args=["--mmproj", a.mmproj])
    try:
        _image_request(server.url, a.model, 64, seed=999)  # load the model and the encoder
        rounds = []
        for i in range(a.rounds):
            alone: list[float] = []
            _stream(server.url, a.model, a.alone_tokens, alone)
            loaded: list[float] = []
            started = threading.Event()
            t = threading.Thread(target=_stream, args=(server.url, a.model, a.tokens, loaded, started))
            t.start()
            started.wait()
            sent, first = _image_request(server.url, a.model, a.size, seed=i)
            t.join()
            gaps = np.diff(loaded)
            during = [g for g, end in zip(gaps, loaded[1:]) if sent <= end <= first]
            unloaded = float(np.median(np.diff(alone)))
            rounds.append({"unloaded_gap_ms": unloaded * 1e3,
                           "during_encode_gap_ms": float(np.median(during)) * 1e3 if during else None,
                           "tokens_during_encode": len(during), "image_ttft_s": first - sent,
                           "ratio": (float(np.median(during)) / unloaded) if during else None})
        ratios = [r["ratio"] for r in rounds if r["ratio"] is not None]
        print(json.dumps({"model": a.model, "mmproj": a.mmproj, "size": a.size, "rounds": rounds,
                          "median_ratio": statistics.median(ratios) if ratios else None}, indent=1))
    finally:
        stop_all()


if __name__ == "__main__":
    main()
