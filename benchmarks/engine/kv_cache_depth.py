"""Decode step cost at depth with the KV cache in bf16 and in q8_0, side by side in one process: one decode row at
context C through the model's whole forward (the fused native stack) and its logits, the KV formats interleaved
rep by rep, plus how many C-token sequences a KV budget holds in each format.

    python benchmarks/engine/kv_cache_depth.py [--model smollm2-135m] [--depths 2048,8192] [--reps 15] [--budget-gb 1]
        [--single-thread] [--device cuda --formats auto,fp8]

`--device cuda` runs the model on the GPU (Triton kernels; fp8 needs sm_89+), each step timed to its end
(torch.cuda.synchronize).

The deep K/V is whatever the pool holds (zeros: the cost does not depend on the values). Prints the median
milliseconds per step for each format and their ratio, as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--depths", default="2048,8192")
    ap.add_argument("--formats", default="auto,q8_0")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--budget-gb", type=float, default=1.0)
    ap.add_argument("--single-thread", action="store_true",
                    help="one thread's CPU time with every kernel on one thread (steady on a busy machine)")
    args = ap.parse_args()

    from edgeserve.bench.cpu_clock import cpu_clock

    clock = cpu_clock(args.single_thread)  # before the native library starts its threads

    from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention, kv_bytes_per_token
    from edgeserve.engine.cache.kv_format import resolve_kv_format
    from edgeserve.kernels.torch.paged_attention import AttentionMetadata
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    lm = load_model(resolve(args.model), device=args.device)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    model, config = lm.model, lm.config
    names = args.formats.split(",")
    fmts = {n: resolve_kv_format(n, config, model.dtype, model.device) for n in names}
    depths = [int(d) for d in args.depths.split(",")]
    bs = 16
    blocks = -(-max(depths) // bs) + 1
    pools = {n: KVPool(config, blocks, bs, f, model.device) for n, f in fmts.items()}
    for depth in depths:
        table = list(range(-(-depth // bs)))
        meta_args = ([1], [depth], [table], [table[(depth - 1) // bs] * bs + (depth - 1) % bs], model.device)
        ids, pos = torch.tensor([11], device=model.device), torch.tensor([depth - 1], device=model.device)
        times: dict[str, list[float]] = {n: [] for n in names}
        with torch.inference_mode():
            for rep in range(args.reps + 2):
                for n in names:
                    t = clock()
                    h = model.forward(ids, pos, PagedKVAttention(pools[n], AttentionMetadata.build(*meta_args)))
                    model.logits(h)
                    sync()
                    if rep >= 2:  # two warm-up reps
                        times[n].append(clock() - t)
        med = {n: statistics.median(v) * 1e3 for n, v in times.items()}
        seqs = {fmts[n].name: int(args.budget_gb * 2**30 // (kv_bytes_per_token(config, fmts[n]) * depth))
                for n in names}
        print(json.dumps({"model": args.model, "depth": depth, "clock": "thread CPU" if args.single_thread else "wall",
                          "ms_per_step": {fmts[n].name: round(m, 2)
                                                                              for n, m in med.items()},
                          "ratio_vs_first": {fmts[n].name: round(med[n] / med[names[0]], 3) for n in names},
                          f"seqs_of_{depth}_in_{args.budget_gb}GiB": seqs}), flush=True)


if __name__ == "__main__":
    main()
