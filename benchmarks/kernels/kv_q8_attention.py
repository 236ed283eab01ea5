"""One decode row's attention at depth over a q8_0 KV pool against the same over bf16, in one process with the calls
interleaved rep by rep (against another commit: run this script in each commit's tree, or
benchmarks/engine/commit_ab.py for the whole decode step).

    python benchmarks/kernels/kv_q8_attention.py [--depths 2048,8192] [--heads 9,3] [--head-dim 64] [--rows 1]
        [--layers 30] [--reps 15] [--single-thread]

The shape defaults to the default model's (SmolLM2-135M: 9 query heads, 3 KV heads, head size 64); `--rows`
decode rows run as one batch, each its own sequence at the depth. A rep calls each kernel over `--layers`
distinct pools in turn, as a decode step does, so K/V come from memory rather than from the cache of the last
call. Prints one JSON line per depth: median microseconds per call (per layer) of each kernel and the ratio of
medians.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="2048,8192")
    ap.add_argument("--heads", default="9,3")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--single-thread", action="store_true",
                    help="one thread everywhere, timed in thread CPU time (steady on a busy machine)")
    args = ap.parse_args()

    from edgeserve.bench.cpu_clock import cpu_clock

    clock = cpu_clock(args.single_thread)  # before the native library starts its threads

    from edgeserve.kernels.cpu import native as cpu_native
    from edgeserve.kernels.formats.kv_quant import quantize_q8
    from edgeserve.kernels.torch.paged_attention import AttentionMetadata

    lib = cpu_native.load(cpu_native.best_variant())
    kernels = {"bf16": lib, "q8_0": lib}
    h, hkv = (int(v) for v in args.heads.split(","))
    d, bs = args.head_dim, args.block_size
    gen = torch.Generator().manual_seed(0)
    for depth in (int(v) for v in args.depths.split(",")):
        per_seq = -(-depth // bs)
        blocks = per_seq * args.rows
        pools: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {"bf16": [], "q8_0": []}
        for _ in range(args.layers):
            k = torch.randn(blocks, bs, hkv, d, generator=gen)
            v = torch.randn(blocks, bs, hkv, d, generator=gen)
            pools["bf16"].append((k.bfloat16(), v.bfloat16()))
            pools["q8_0"].append((quantize_q8(k), quantize_q8(v)))
        perm = torch.randperm(blocks, generator=gen)  # scattered blocks, as a pool's are after a while
        tables = [perm[i * per_seq:(i + 1) * per_seq].tolist() for i in range(args.rows)]
        meta = AttentionMetadata.build([1] * args.rows, [depth] * args.rows, tables,
                                       [t[-1] * bs + (depth - 1) % bs for t in tables])
        q = torch.randn(args.rows, h, d, generator=gen).bfloat16()
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for _ in range(args.reps):
            for name, impl in kernels.items():
                layers = pools[name.split(" ")[0]]
                t0 = clock()
                for kc, vc in layers:
                    cpu_native.paged_attention(q, kc, vc, meta, None, lib=impl)
                times[name].append((clock() - t0) * 1e6 / len(layers))
        med = {name: statistics.median(ts) for name, ts in times.items()}
        row = {"depth": depth, "rows": args.rows, "layers": args.layers, "heads": [h, hkv], "head_dim": d,
               "median_us": {n: round(m, 1) for n, m in med.items()},
               "q8_0/bf16": round(med["q8_0"] / med["bf16"], 3)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
