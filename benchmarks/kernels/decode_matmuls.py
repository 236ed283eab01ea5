"""Native matmul time of one decode step of a GGUF model (its real layer-0 and output weights) at batch 1 (or
each of `--batch`), this checkout's kernels (against another commit: run it in each commit's tree).

    python benchmarks/kernels/decode_matmuls.py [--model PATH.gguf] [--rounds 5] [--single-thread]
        [--batch 1,4,8]

Times the raw `qmm_matmul` call (activations quantized once beforehand; no Python wrapper) for each matrix a Llama
layer multiplies by (q/k/v stacked, o, gate/up stacked, down) and for the output head; a step's matmul time is
layers x (layer 0's matrices) + head. Blocks of calls alternate between the libraries (with a pause, so the other
library's pool workers go to sleep); the figure is the median over rounds of each block's median. With
`--single-thread` both run one thread and are timed in thread CPU time (steady on a busy machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from gguf import GGUFReader

from edgeserve.bench.cpu_clock import cpu_clock
from edgeserve.bench.timing import call_times
from edgeserve.kernels.cpu.native import BlockTensor, BlockWeight, best_variant, load, native_format

LAYER = [["attn_q", "attn_k", "attn_v"], ["attn_output"], ["ffn_gate", "ffn_up"], ["ffn_down"]]


def step_matrices(reader: GGUFReader) -> tuple[int, list[list[BlockTensor]]]:
    """(layer count, the block tensors of layer 0's stacked matrices and of the output head)."""
    tensors = {t.name: t for t in reader.tensors}
    layers = 1 + max(int(n.split(".")[1]) for n in tensors if n.startswith("blk."))

    def block(name: str) -> BlockTensor:
        t = tensors[name]
        cols = int(t.shape[0])
        data = torch.from_numpy(t.data.reshape(int(t.shape[1]), -1).copy())
        if not native_format(t.tensor_type.name, cols):
            raise SystemExit(f"{name}: {t.tensor_type.name} is not a native format")
        return BlockTensor(t.tensor_type.name, data, cols)

    mats = [[block(f"blk.0.{n}.weight") for n in group] for group in LAYER]
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    return layers, mats + [[block(head)]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.path.expanduser(
        "~/.cache/edgeserve/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50, help="calls per block (the head gets a tenth)")
    ap.add_argument("--single-thread", action="store_true")
    ap.add_argument("--batch", default="1", help="activation rows per call, one step figure each (1,4,8)")
    args = ap.parse_args()
    for m in (int(b) for b in args.batch.split(",")):
        run(args, m)


def run(args: argparse.Namespace, m: int) -> None:
    """Time one decode step's matmuls at batch m and print them."""
    clock = cpu_clock(args.single_thread)
    libs = {"this checkout": load(best_variant())}
    layers, mats = step_matrices(GGUFReader(args.model))
    print(f"{args.model}: {layers} layers, batch {m}, "
          f"{'1 thread' if args.single_thread else 'threads from torch/EDGESERVE_THREADS'}")
    per_step = {name: 0.0 for name in libs}
    for i, parts in enumerate(mats):
        count = 1 if i == len(mats) - 1 else layers
        calls = max(5, args.calls // 10) if count == 1 else args.calls
        k = parts[0].cols
        x = torch.randn(m, k)
        fns = {}
        for name, lib in libs.items():
            w = BlockWeight(parts, lib)
            qa, da, sa = w.quantize(x)
            out = torch.empty(m, w.out_features)

            def call(w=w, qa=qa, da=da, sa=sa, out=out) -> None:
                col = 0
                for fmt, p in zip(w._fmt, w.parts):
                    w.lib.qmm_matmul(fmt, p.data.data_ptr(), p.data.shape[1], p.data.shape[0], k, qa.data_ptr(),
                                     da.data_ptr(), sa.data_ptr(), m, out.data_ptr() + 4 * col, w.out_features)
                    col += p.data.shape[0]
            fns[name] = call
        meds: dict[str, list[float]] = {name: [] for name in libs}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                time.sleep(0.02)
                meds[name].append(statistics.median(call_times(fn, calls, warmup=1, clock=clock)) * 1e6)
        shape = f"{sum(p.data.shape[0] for p in parts)}x{k} {'+'.join(sorted({p.qtype for p in parts}))}"
        row = ", ".join(f"{name} {statistics.median(v):8.1f} us" for name, v in meds.items())
        print(f"{shape:<24} x{count:<3} {row}", flush=True)
        for name, v in meds.items():
            per_step[name] += count * statistics.median(v) / 1e3
    print(f"matmul ms per decode step of {m} rows: " + ", ".join(
        f"{name} {ms:.2f} ({ms / m:.2f} per row)" for name, ms in per_step.items()))


if __name__ == "__main__":
    main()
