"""What the q8_0 KV cache costs in quality: next-token KL divergence and top-1 agreement against the bf16 KV cache
(and, for scale, bf16 and q8_0 against a float32 KV cache) over a fixed text, per model and length
(edgeserve.bench.kv_quality).

    python benchmarks/quality/kv_quality.py MODEL.gguf [MODEL.gguf ...] [--lengths 512,2048] [--text FILE ...]
        [--pairs q8_0:auto,fp8:auto]

`--pairs`: candidate:reference formats (`--kv-cache-dtype` names, or f32); fp8 runs through the torch twins where
the Triton kernels do not (the format's cost, not its speed).

The text defaults to this checkout's README.md and docs/ENGINE.md, concatenated. One JSON line per model,
length and pair.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAIRS = (("q8_0", "auto"), ("auto", "f32"), ("q8_0", "f32"))  # (candidate, reference)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--pairs", default=",".join(f"{c}:{r}" for c, r in PAIRS))
    ap.add_argument("--text", nargs="*", default=[str(ROOT / "README.md"), str(ROOT / "docs" / "ENGINE.md")])
    args = ap.parse_args()

    from edgeserve.bench.kv_quality import kv_divergence
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    text = "".join(Path(p).read_text() for p in args.text)
    for path in args.models:
        lm = load_model(resolve(path))
        ids = lm.tokenizer.encode(text)
        for n in (int(x) for x in args.lengths.split(",")):
            for cand, ref in (p.split(":") for p in args.pairs.split(",")):
                t = time.perf_counter()
                d = kv_divergence(lm, ids[:n], candidate=cand, reference=ref)
                print(json.dumps({"model": Path(path).name, "tokens": d.positions, "candidate": cand,
                                  "reference": ref, "mean_kl": round(d.mean_kl, 5), "max_kl": round(d.max_kl, 4),
                                  "top1_agreement": round(d.top1_agreement, 4),
                                  "seconds": round(time.perf_counter() - t, 1)}), flush=True)


if __name__ == "__main__":
    main()
