"""kernels.torch.mamba2's chunked SSD scan beside one step per token over a prompt, on one Mamba-2 layer of Nemotron-H-8B's
shape (128 heads x 64 values, state 128, 8 groups), float32 torch: the same outputs, and each one's time, run
alternately in one process (report the ratio)."""

from __future__ import annotations

import argparse

import torch

from edgeserve.bench.timing import alternate
from edgeserve.kernels.torch.gated_delta import DeltaBatch
from edgeserve.kernels.torch.mamba2 import ssd_scan, ssd_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    t, h, p, g, n = args.tokens, 128, 64, 8, 128
    x, dt = torch.randn(t, h, p), torch.rand(t, h) * 0.1
    B, C, A, D = torch.randn(t, g, n), torch.randn(t, g, n), -torch.rand(h), torch.randn(h)
    batch = DeltaBatch.build([0, t], [0])

    def chunked() -> torch.Tensor:
        return ssd_scan(x, dt, A, B, C, D, torch.zeros(1, h, p, n), batch)

    def steps() -> torch.Tensor:
        state, ys = torch.zeros(1, h, p, n), []
        for i in range(t):
            y, state = ssd_step(x[i:i + 1], dt[i:i + 1], A, B[i:i + 1], C[i:i + 1], D, state)
            ys.append(y)
        return torch.cat(ys)

    torch.testing.assert_close(chunked(), steps(), atol=1e-3, rtol=1e-3)
    for _ in range(args.rounds):
        ab = alternate({"chunked": chunked, "steps": steps}, rounds=1, warmup=0)
        print(f"chunked {ab.median_ms('chunked') / 1e3:.3f} s, one step per token {ab.median_ms('steps') / 1e3:.3f} s: "
              f"{ab.ratio('steps', 'chunked'):.1f}x")

if __name__ == "__main__":
    main()
