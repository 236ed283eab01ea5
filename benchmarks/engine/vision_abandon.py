"""How long an abandoned image request keeps the encoder busy: the seconds from the moment its client goes away
to the moment the encoder is free for the next request, with the check between the tower's layers
(vision/stop.py) and with the check between image batches only (as before).

    python benchmarks/engine/vision_abandon.py --model gemma-3-270m.gguf --mmproj mmproj-gemma3-4b-to640-f16.gguf

Loads the model with the projector (torch's threads as they are), encodes one --size image to warm up and time a
whole encode, then per round, alternating the order: a request of --images distinct images is encoded in a thread
(VisionRuntime.embeddings, the server's path) and abandoned --after seconds in; the time until that call returns
is the wait. Prints one JSON object (every sample, medians, the ratio)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import numpy as np
from PIL import Image

import edgeserve.vision.vit as vit
from edgeserve.llm import LLM


def abandoned_wait(runtime, prepared: list, after: float, layers: bool) -> float:
    """Seconds from abandoning an encode of `prepared` (`after` s in) until the encoder call returns."""
    runtime._cache.clear()
    keys = [os.urandom(16) for _ in prepared]
    gone = threading.Event()
    returned: list[float] = []
    check = vit.check_stop
    vit.check_stop = check if layers else (lambda: None)

    def run() -> None:
        try:
            runtime.embeddings(prepared, keys, gone.is_set)
        except RuntimeError:  # EncodeAbandoned
            pass
        returned.append(time.perf_counter())

    try:
        worker = threading.Thread(target=run)
        worker.start()
        time.sleep(after)
        t0 = time.perf_counter()
        gone.set()
        worker.join()
    finally:
        vit.check_stop = check
    return returned[0] - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--mmproj", required=True)
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--after", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    llm = LLM(args.model, mmproj=args.mmproj)
    runtime = llm.lm.vision
    rng = np.random.default_rng(0)
    prepared = [runtime.family.preprocess(Image.fromarray(rng.integers(0, 256, (args.size, args.size, 3),
                                                                       dtype=np.uint8)))
                for _ in range(args.images)]
    t0 = time.perf_counter()
    runtime.embeddings(prepared[:1], [os.urandom(16)])
    one = time.perf_counter() - t0
    samples: dict[str, list[float]] = {"between_layers": [], "between_batches": []}
    for r in range(args.rounds):
        for mode in (list(samples) if r % 2 == 0 else list(samples)[::-1]):
            samples[mode].append(round(abandoned_wait(runtime, prepared, args.after, mode == "between_layers"), 3))
            print(json.dumps({mode: samples[mode][-1]}), flush=True)
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(json.dumps({"one_image_encode_s": round(one, 3), "images": args.images, "after_s": args.after,
                      "samples": samples, "medians": med,
                      "between_batches_over_between_layers": round(med["between_batches"] / med["between_layers"],
                                                                   1)}, indent=1))


if __name__ == "__main__":
    main()
