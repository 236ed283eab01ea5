"""Time one MoE layer of Qwen3-30B-A3B's shape on the native CPU kernels (random Q4_K gate/up and Q6_K down
experts, as a Q4_K_M file's first layers store them): per step of T tokens, in the GGUF layout (read in place,
as from a memory map) and repacked: the whole layer in one native call (kernels/cpu/src/moe_layer.c, "layer call"),
and the torch path around the grouped call (qmm_moe_matmul, "one call") or a matmul per expert.

    EDGESERVE_THREADS=1 python benchmarks/kernels/moe_layer.py --tokens 1 4 64

Reports process CPU time and median wall time per layer forward (on a shared machine wall time mostly measures the
neighbours); run it with EDGESERVE_THREADS=1 and 2 to see whether a decode row's experts keep both threads busy.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from edgeserve.bench.random_gguf import random_blocks
from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.formats.experts import BlockExperts, ExpertBlocks
from edgeserve.models.moe import MoEConfig, MoELayer


def layer(hidden: int, ffn: int, experts: int, used: int, repack: bool, seed: int = 0) -> MoELayer:
    """A MoE layer of random block-format experts."""
    rng = np.random.default_rng(seed)
    gate, up, down = (np.stack([random_blocks(q, r, c, rng) for _ in range(experts)])
                      for q, r, c in (("Q4_K", ffn, hidden), ("Q4_K", ffn, hidden), ("Q6_K", hidden, ffn)))
    router = torch.randn(experts, hidden, generator=torch.Generator().manual_seed(seed)) * 0.05
    return MoELayer(MoEConfig(experts, used, ffn, normalize_topk=True), router,
                    BlockExperts([ExpertBlocks("Q4_K", gate, hidden), ExpertBlocks("Q4_K", up, hidden)], repack=repack),
                    BlockExperts([ExpertBlocks("Q6_K", down, ffn)], repack=repack))


def cpu_ms(fn, seconds: float) -> tuple[float, float]:
    """(process CPU ms, median wall ms) per call of fn, over about `seconds` of wall time."""
    fn()
    n, t0, c0, walls = 0, time.perf_counter(), time.process_time(), []
    while time.perf_counter() - t0 < seconds:
        w = time.perf_counter()
        fn()
        walls.append((time.perf_counter() - w) * 1e3)
        n += 1
    return (time.process_time() - c0) / n * 1e3, statistics.median(walls)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 64])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--used", type=int, default=8)
    p.add_argument("--seconds", type=float, default=3.0)
    args = p.parse_args()
    for repack in (False, True):
        moe = layer(args.hidden, args.ffn, args.experts, args.used, repack)
        for tokens in args.tokens:
            h = torch.randn(tokens, args.hidden, generator=torch.Generator().manual_seed(tokens)).to(torch.bfloat16)
            native = moe.native()
            for way in ("layer call", "one call", "per expert"):
                moe._native = native if way == "layer call" else None
                moe.gate_up.one_call = moe.down.one_call = way != "per expert"
                ms, wall = cpu_ms(lambda: moe.forward(h), args.seconds)
                print(f"{'repacked' if repack else 'GGUF layout'}  tokens {tokens:4d}  {way:10s}  {ms:8.2f} ms CPU "
                      f"{wall:8.2f} ms wall per layer  ({cpu_native.threads()} threads)", flush=True)
            moe._native = native


if __name__ == "__main__":
    main()
