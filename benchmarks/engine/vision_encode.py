"""Time edgeserve's vision encoder on one image, on random-weight mmproj files of real shapes (or a given one).

    python benchmarks/engine/vision_encode.py --family smolvlm-256m --qtype F16 --size 512 [--repeat 2] [--keep DIR]

Writes the mmproj (clip.cpp's tensor names, as llama.cpp's converter would) unless --mmproj names one, loads it as
the server does (bf16 compute: Q8_0 matrices on the native CPU kernels, F16 ones as bf16), and prints the
preprocessing and encode seconds (median of --repeat) as JSON. The same file serves llama-server's --mmproj.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from PIL import Image

from edgeserve.bench.random_mmproj import SIGLIP_SHAPES, write_siglip_mmproj


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=sorted(SIGLIP_SHAPES), default="smolvlm-256m")
    ap.add_argument("--qtype", choices=["F16", "Q8_0"], default="F16")
    ap.add_argument("--mmproj", default=None, help="time this file instead of writing a random one")
    ap.add_argument("--keep", default=None, metavar="DIR", help="write the random mmproj here and keep it")
    ap.add_argument("--size", type=int, default=512, help="the image's width and height (default %(default)s)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = ap.parse_args()
    from edgeserve.vision.family import load_vision

    shape = SIGLIP_SHAPES[args.family]
    folder = Path(args.keep or tempfile.mkdtemp())
    folder.mkdir(parents=True, exist_ok=True)
    path = Path(args.mmproj) if args.mmproj else write_siglip_mmproj(
        folder / f"mmproj-{args.family}-{args.qtype}.gguf", shape, args.qtype)
    t0 = time.perf_counter()
    family = load_vision(path, SimpleNamespace(hidden_size=shape["lm"]), dtype=getattr(torch, args.dtype))
    load_s = time.perf_counter() - t0
    img = Image.fromarray(np.random.default_rng(1).integers(0, 256, (args.size, args.size, 3), dtype=np.uint8))
    pre, enc = [], []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        prepared = family.preprocess(img)
        pre.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        rows = family.encode([prepared])[0]
        enc.append(time.perf_counter() - t0)
    print(json.dumps({"family": args.family, "qtype": args.qtype, "dtype": args.dtype, "mmproj": str(path),
                      "image": f"{args.size}x{args.size}", "frames": int(prepared.pixel_values.shape[0]),
                      "tokens": int(rows.shape[0]), "threads": torch.get_num_threads(), "load_s": round(load_s, 2),
                      "preprocess_s": round(statistics.median(pre), 3), "encode_s": round(statistics.median(enc), 2),
                      "encode_runs_s": [round(e, 2) for e in enc]}))


if __name__ == "__main__":
    main()
