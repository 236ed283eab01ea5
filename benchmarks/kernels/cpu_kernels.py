"""Native quantized GEMV/GEMM (kernels/cpu/src/qmm/) against torch's CPU int4 and bf16 matmuls, side by side.

    python benchmarks/kernels/cpu_kernels.py [--shape 8192x2048] [--batch 1,8,64] [--reps 9] [--single-thread]

Against another commit: run it in each commit's tree (benchmarks/kernels/qmm_bits_ab.py checks the bits, and
benchmarks/engine/commit_ab.py times a whole decode step, each commit from its own tree).

For each weight format and batch size: median milliseconds per call and the weight bytes read per second
(GB/s from the median and from the fastest call; the weight is read once per call). MXFP4 weights get random
codes and exponents of 2^-11 .. 2^-2. torch int4 is `_weight_int4pack_mm_for_cpu` with group 32 (bf16
activations), bf16 is a dense `x @ W.T`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from edgeserve.bench.cpu_clock import cpu_clock
from edgeserve.bench.random_gguf import random_blocks
from edgeserve.kernels.cpu.native import BlockTensor, BlockWeight, best_variant, load, native_format, threads
from edgeserve.bench.timing import call_times
from edgeserve.kernels.formats.quant_linear import Int4Weight, Q4Blocks


def times_ms(fn, reps: int, clock=time.perf_counter) -> tuple[float, float]:
    """(median, minimum) milliseconds per call by `clock`; on a busy machine the minimum is the steadier figure."""
    times = call_times(fn, reps, warmup=1, clock=clock)
    return statistics.median(times) * 1e3, min(times) * 1e3


def weight_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random stored bytes [rows, bytes per row] of a `qtype` weight (edgeserve.bench.random_gguf's, and MXFP4's)."""
    if qtype != "MXFP4":
        return random_blocks(qtype, rows, cols, rng)
    blocks = rng.integers(0, 256, size=(rows, cols // 32, 17), dtype=np.uint8)
    blocks[:, :, 0] = rng.integers(117, 127, size=(rows, cols // 32), dtype=np.uint8)  # E8M0 exponents
    return blocks.reshape(rows, -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8192x2048", help="out x in")
    ap.add_argument("--batch", default="1,8,64")
    ap.add_argument("--formats", default="Q4_0,Q4_K,Q6_K,Q8_0")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--single-thread", action="store_true",
                    help="one thread everywhere, timed in thread CPU time (steady on a busy machine)")
    args = ap.parse_args()
    clock = cpu_clock(args.single_thread)
    n, k = (int(v) for v in args.shape.split("x"))
    rng = np.random.default_rng(0)
    lib = load(best_variant())
    print(f"variant {best_variant()}, {threads()} threads, torch {torch.get_num_threads()} threads, W {n}x{k}")
    dense = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
    int4 = Int4Weight(Q4Blocks.quantize(dense.float(), 32), torch.bfloat16)
    print(f"{'kernel':<20}{'batch':>6}{'median ms':>11}{'min ms':>9}{'GB/s (med)':>12}{'GB/s (min)':>12}")
    for m in (int(b) for b in args.batch.split(",")):
        x = torch.randn(m, k)
        xb = x.bfloat16()
        rows = [("torch bf16", dense.numel() * 2, lambda: xb @ dense.T),
                ("torch int4", n * k // 2 + n * k // 32 * 4, lambda: int4.matmul(xb))]
        for qt in args.formats.split(","):
            if not native_format(qt, k):
                continue  # e.g. a K-quant (256 per block) over K=576
            blocks = BlockTensor(qt, torch.from_numpy(weight_blocks(qt, n, k, rng)), k)
            w = BlockWeight([blocks], lib)
            rows.append((qt, w.parts[0].data.numel(), lambda w=w: w.matmul(x)))
        for name, nbytes, fn in rows:
            med, low = times_ms(fn, args.reps, clock)
            print(f"{name:<20}{m:>6}{med:>11.2f}{low:>9.2f}{nbytes / med / 1e6:>12.1f}{nbytes / low / 1e6:>12.1f}")


if __name__ == "__main__":
    main()
