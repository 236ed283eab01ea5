"""Single-thread time of every layer matmul of a GGUF file (any architecture: each `blk.*` weight in a native block
format, on its own) at M activation rows, this checkout's native library against a baseline library, per format,
with the two libraries' outputs asserted bit-equal.

    python benchmarks/kernels/gguf_matmuls_ab.py MODEL.gguf --baseline-lib OLD.so [--rows 512] [--reps 3]

One thread (`EDGESERVE_THREADS=1`), timed in thread CPU time (steady on a busy machine); calls alternate between
the libraries, and each weight's figure is its fastest call. Build OLD.so as `benchmarks/engine/native_lib_prefill_ab.py`
says. Prints the total per format (milliseconds, this / base) and over all weights: a prompt chunk of M rows costs
one call of each.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("EDGESERVE_THREADS", "1")

import time  # noqa: E402

import torch  # noqa: E402
from gguf import GGUFReader  # noqa: E402

from edgeserve.kernels.cpu.native import BlockTensor, BlockWeight, _bind, library, native_format  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--baseline-lib", required=True)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    mine, base = library(), _bind(ctypes.CDLL(args.baseline_lib))
    assert mine is not None, "the native library is not available here"
    gen = torch.Generator().manual_seed(0)
    totals: collections.Counter = collections.Counter()
    for t in GGUFReader(args.model).tensors:
        qtype, n, k = t.tensor_type.name, int(t.shape[-1]), int(t.shape[0])
        if not t.name.startswith("blk.") or len(t.shape) != 2 or not native_format(qtype, k):
            continue
        data = torch.from_numpy(t.data.copy()).view(torch.uint8).reshape(n, -1)
        w = BlockWeight([BlockTensor(qtype, data, k)], mine)
        x = torch.randn(args.rows, k, generator=gen)
        best: dict[str, float] = {}
        out: dict[str, torch.Tensor] = {}
        for name, lib in [("this", mine), ("base", base)] * (args.reps + 1):
            w.lib = lib
            start = time.thread_time()
            out[name] = w.matmul(x)
            best[name] = min(best.get(name, float("inf")), time.thread_time() - start)
        assert torch.equal(out["this"], out["base"]), f"{t.name}: the libraries disagree"
        for name in best:
            totals[(qtype, name)] += best[name]
            totals[("all", name)] += best[name]
    for qtype in sorted({q for q, _ in totals}, key=lambda q: q == "all"):
        this, was = totals[(qtype, "this")] * 1e3, totals[(qtype, "base")] * 1e3
        print(f"{qtype:6s} this {this:8.1f} ms  base {was:8.1f} ms  this / base {this / was:.3f}")


if __name__ == "__main__":
    main()
