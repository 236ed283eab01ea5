"""In-process A/B: a decoding stream's step time while an image is encoded beside it, with the encoder in a plain
thread at the engine's priority (as before) and on the vision runtime's own nicer thread (VisionRuntime.encoder_nice).

    python benchmarks/engine/vision_interference_ab.py --model LM.gguf [--layers 3] [--rounds 3] [--nice 10 19]

Writes a random-weight Gemma 3 tower mmproj (SigLIP so400m's shape with `--layers` of its 27 layers, F16, projecting
into the language model's width), loads the model with it (torch's 2 threads), then per round, in alternating
order: the stream alone, then the stream while the image is encoded in a plain thread; alone again, then while it
is encoded on the runtime's thread (once per `--nice` value). A stream is a greedy `ignore_eos` request stepped by
this process (one token per step). Reported per mode: the median step gap during the encode over the median alone
just before, and the encode's seconds; then the medians over rounds. Prints one JSON object. For the server-level
figure see vision_interference.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from PIL import Image

from edgeserve.bench.random_mmproj import SIGLIP_SHAPES, write_siglip_mmproj
from edgeserve.engine.delivery import Outbox, step_and_deliver
from edgeserve.llm import LLM
from edgeserve.sampling_params import SamplingParams
from edgeserve.vision.runtime import ENCODER_NICE, VisionRuntime


def _stream_gaps(llm: LLM, ids: list[int], until: threading.Event, min_steps: int) -> list[float]:
    """Step a fresh greedy stream until `until` is set and at least `min_steps` steps ran; each step's seconds."""
    outbox = Outbox()
    rid = llm.engine.add_request(ids, SamplingParams(max_tokens=100000, temperature=0.0, ignore_eos=True))
    outbox.open(rid, lambda out: None)
    for _ in range(3):  # the prompt and the first decodes
        step_and_deliver(llm.engine, outbox)
    gaps = []
    t = time.perf_counter()
    while not until.is_set() or len(gaps) < min_steps:
        step_and_deliver(llm.engine, outbox)
        now = time.perf_counter()
        gaps.append(now - t)
        t = now
    llm.engine.finish_request(rid)
    while llm.engine.has_work():
        step_and_deliver(llm.engine, outbox)
    return gaps


def _with_encode(llm: LLM, ids: list[int], encode) -> tuple[list[float], float]:
    """The stream's step gaps while `encode()` runs in a thread, and the encode's seconds."""
    done, took = threading.Event(), []

    def run() -> None:
        t0 = time.perf_counter()
        encode()
        took.append(time.perf_counter() - t0)
        done.set()

    worker = threading.Thread(target=run)
    worker.start()
    gaps = _stream_gaps(llm, ids, done, 5)
    worker.join()
    return gaps, took[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Gemma 3 GGUF (its vocabulary has Gemma 3's image tokens)")
    ap.add_argument("--layers", type=int, default=3, help="tower layers (the real Gemma 3 tower has 27)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--alone-steps", type=int, default=80)
    ap.add_argument("--nice", type=int, nargs="+", default=[ENCODER_NICE], help="the encoder thread's nice steps")
    a = ap.parse_args()
    from edgeserve.models.config import config_from_gguf
    from edgeserve.loaders.gguf_file import GGUFFile

    g = GGUFFile(a.model)
    width = config_from_gguf(g.metadata, set(g.tensor_names())).hidden_size
    shape = dict(SIGLIP_SHAPES["gemma3-4b"], layers=a.layers, lm=width)
    with tempfile.TemporaryDirectory() as tmp:
        mmproj = write_siglip_mmproj(Path(tmp) / "mmproj-gemma3.gguf", shape, "F16")
        llm = LLM(a.model, mmproj=str(mmproj))
        runtime = llm.lm.vision
        rng = np.random.default_rng(0)
        image = Image.fromarray(rng.integers(0, 256, (512, 512, 3), dtype=np.uint8))
        prepared = runtime.family.preprocess(image)
        ids = llm.tokenizer.encode("Once upon a time", add_special_tokens=False)
        modes = {"plain_thread": lambda: runtime.family.encode([prepared])}
        for nice in a.nice:
            niced = VisionRuntime(runtime.family, encoder_nice=nice)
            modes[f"encoder_thread_nice{nice}"] = lambda niced=niced: niced._encode([prepared])
        for encode in modes.values():  # warm every path (and start the encoder threads)
            encode()
        rounds = []
        for r in range(a.rounds):
            row = {}
            for name in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
                never = threading.Event()
                never.set()
                alone = _stream_gaps(llm, ids, never, a.alone_steps)
                loaded, seconds = _with_encode(llm, ids, modes[name])
                row[name] = {"alone_ms": float(np.median(alone)) * 1e3, "during_ms": float(np.median(loaded)) * 1e3,
                             "ratio": float(np.median(loaded) / np.median(alone)), "encode_s": seconds,
                             "steps_during": len(loaded)}
            rounds.append(row)
            print(json.dumps(row), flush=True)
        summary = {name: {"median_ratio": statistics.median(r[name]["ratio"] for r in rounds),
                          "median_encode_s": statistics.median(r[name]["encode_s"] for r in rounds)}
                   for name in modes}
        print(json.dumps({"model": a.model, "layers": a.layers, "rounds": rounds,
                          "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
