"""The batch-invariant W4A16 path (EDGESERVE_BATCH_INVARIANT=1) against the default GEMV at batch 1, on a CUDA GPU.

For the Llama-3-8B matrices: GB/s of the default GEMV and of the invariant path (16-row tiles, K split by the
weight alone) over a sweep of launch shapes, timed over CUDA-graph replays; then whether each invariant shape keeps
a row's result bit for bit at M = 1, 7 and 40.

    python benchmarks/kernels/w4a16_invariant.py
"""

from __future__ import annotations

import sys

import torch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main() -> int:
    if not torch.cuda.is_available():
        print("w4a16_invariant: needs a CUDA GPU")
        return 1
    from edgeserve.kernels.triton import w4a16 as tw
    from edgeserve.kernels.triton.bench import graph_median_ms
    from edgeserve.kernels.formats.quant_linear import Q4Blocks
    from edgeserve.kernels.formats.w4a16 import repack_q4

    configs = [tw.InvariantConfig(block_n=bn, block_k=bk, programs_per_sm=p)
               for bn in (32, 64) for bk in (32, 64, 128) for p in (2, 4, 8)]
    rows = []
    for name, (n, k) in SHAPES.items():
        blocks = Q4Blocks(torch.randint(0, 16, (n, k), dtype=torch.uint8), torch.rand(n, k // 128) * 0.01,
                          torch.randn(n, k // 128) * 0.01, 128)
        w = repack_q4(blocks, torch.bfloat16, "cuda")
        x = torch.randn(40, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        gb = w.nbytes / 1e9
        ms = graph_median_ms(lambda: tw.gemv(x[:1], w, y, tw.GEMV_CONFIG))
        rows.append((name, "gemv (default)", gb / ms * 1e3, ""))
        for c in configs:
            ms = graph_median_ms(lambda: tw.invariant_matmul(x[:1], w, y, c))
            outs = []
            for m in (1, 7, 40):
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                tw.invariant_matmul(x[:m], w, out, c)
                outs.append(out[0])
            same = all(torch.equal(outs[0], o) for o in outs[1:])
            rows.append((name, f"inv bn{c.block_n} bk{c.block_k} p{c.programs_per_sm}", gb / ms * 1e3,
                         "same" if same else "DIFFERS"))
    print(f"{'matrix':8} {'path':24} {'GB/s':>8}  invariant")
    for r in rows:
        print(f"{r[0]:8} {r[1]:24} {r[2]:8.0f}  {r[3]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
