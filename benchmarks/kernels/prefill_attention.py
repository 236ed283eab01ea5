"""Native paged attention (kernels/cpu/src/attention.c) over prompt chunks and decode rows, this checkout against a
library built from another commit, side by side, with a bit-for-bit check of every output.

    python benchmarks/kernels/prefill_attention.py --baseline-lib OLD.so [--heads 9 --kv-heads 3 --head-dim 64]
        [--cases prefill:512@512,prefill:512@2000,prefill:512@4000,decode:8@2000,decode:1@4000] [--reps 5]

`OLD.so` is a `qmatmul-avx2-*.so` from `<edgeserve home>/native/` built at the other commit (or the same sources
compiled by hand with the flags of kernels/cpu_native.build). A case `prefill:R@C` is one sequence's chunk of R
prompt rows whose last row sees C positions (rows see C-R+1 .. C); `decode:N@C` is N sequences of one row each
at context C. The default heads are the default model's (SmolLM2-135M: 9 query heads, 3 kv heads, D 64), the
pool bfloat16 in blocks of 16 as the engine keeps it. Prints the median milliseconds per call of each side, the
ratio, and whether the outputs are identical.

`--engine-lengths 1000,4000` then times the engine's prefill (a 1-token generation, prefix cache off) of prompts
of those lengths on `--model` (default smollm2-135m), one model and engine whose fused native layer stack is
switched between the two libraries run by run, and checks that both sides pick the same first token.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

from edgeserve.bench.timing import alternate
from edgeserve.kernels.cpu.native import _bind, best_variant, load, threads

TEXT = "the quick brown fox jumps over the lazy dog and then " * 600

BLOCK = 16


def case_inputs(kind: str, rows: int, ctx: int, heads: int, kv_heads: int, d: int, dtype: torch.dtype):
    """q [T, H, D], K/V pools, block tables and the per-row (sequence, length) plan of one case."""
    g = torch.Generator().manual_seed(rows * 7919 + ctx)
    seqs = 1 if kind == "prefill" else rows
    per_seq = -(-ctx // BLOCK)
    blocks = seqs * per_seq + 3
    k = torch.randn(blocks, BLOCK, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(blocks, BLOCK, kv_heads, d, generator=g).to(dtype)
    tables = torch.randperm(blocks, generator=g)[: seqs * per_seq].view(seqs, per_seq).to(torch.int32).contiguous()
    if kind == "prefill":
        row_seq = torch.zeros(rows, dtype=torch.int32)
        row_len = torch.arange(ctx - rows + 1, ctx + 1, dtype=torch.int32)
    else:
        row_seq = torch.arange(rows, dtype=torch.int32)
        row_len = torch.full((rows,), ctx, dtype=torch.int32)
    q = torch.randn(rows, heads, d, generator=g).to(dtype)
    return q, k, v, tables, row_seq, row_len


def attend(lib: ctypes.CDLL, q, k, v, tables, row_seq, row_len) -> torch.Tensor:
    """One qmm_paged_attention call; returns the output."""
    t, h, d = q.shape
    out = torch.empty_like(q)
    bf16 = q.dtype == torch.bfloat16
    lib.qmm_paged_attention(q.data_ptr(), bf16, t, h, d, k.data_ptr(), v.data_ptr(), k.dtype == torch.bfloat16,
                            BLOCK, k.shape[2], tables.data_ptr(), tables.stride(0), row_seq.data_ptr(),
                            row_len.data_ptr(), d ** -0.5, out.data_ptr())
    return out


def engine_prefill(libs: dict[str, ctypes.CDLL], model: str, lengths: list[int], runs: int) -> None:
    """Median seconds of a 1-token generation over prompts of `lengths` tokens with each library in the fused
    layer stack of one loaded model."""
    from edgeserve import LLM, SamplingParams
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    llm = LLM.from_model(load_model(resolve(model)), kv_cache_gb=0.25, enable_prefix_caching=False)
    native = llm.lm.model.native_decoder()
    if native is None:
        raise SystemExit(f"{model} does not run on the fused native stack here")
    ids = llm.tokenizer.encode(TEXT)
    params = SamplingParams(temperature=0, max_tokens=1)
    print(f"{'prompt tokens':>13}{'base s':>9}{'this s':>9}{'speed-up':>10}  same token")
    for n in lengths:
        times: dict[str, list[float]] = {name: [] for name in libs}
        first: dict[str, list[int]] = {}
        for r in range(runs + 1):  # the first round warms up
            for name, lib in libs.items():
                native.lib = lib
                t = time.perf_counter()
                out = llm.generate([ids[:n]], params)
                if r:
                    times[name].append(time.perf_counter() - t)
                first[name] = out[0].outputs[0].token_ids
        base, this = (statistics.median(times[n]) for n in ("base", "this"))
        print(f"{n:>13}{base:>9.2f}{this:>9.2f}{base / this:>9.2f}x  {first['base'] == first['this']}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-lib", required=True, help="a native library built from another commit")
    ap.add_argument("--cases", default="prefill:512@512,prefill:512@2000,prefill:512@4000,decode:8@2000,decode:1@4000")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--engine-lengths", help="also time the engine's prefill of prompts this long, e.g. 1000,4000")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--runs", type=int, default=3, help="engine rounds per side and length")
    args = ap.parse_args()
    libs = {"this": load(best_variant()), "base": _bind(ctypes.CDLL(args.baseline_lib))}
    dtype = getattr(torch, args.dtype)
    print(f"variant {best_variant()}, {threads()} threads, H {args.heads}, Hkv {args.kv_heads}, D {args.head_dim}, "
          f"{args.dtype}")
    print(f"{'case':<20}{'base ms':>10}{'this ms':>10}{'speed-up':>10}  identical")
    for case in args.cases.split(","):
        kind, shape = case.split(":")
        rows, ctx = (int(x) for x in shape.split("@"))
        inputs = case_inputs(kind, rows, ctx, args.heads, args.kv_heads, args.head_dim, dtype)
        outs = {name: attend(lib, *inputs) for name, lib in libs.items()}
        same = torch.equal(outs["this"].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           outs["base"].view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
        # alternated, so drift on a shared machine hits both sides
        ab = alternate({name: (lambda lib=lib: attend(lib, *inputs)) for name, lib in libs.items()}, args.reps, warmup=0)
        base, this = ab.median_ms("base"), ab.median_ms("this")
        print(f"{case:<20}{base:>10.2f}{this:>10.2f}{base / this:>9.2f}x  {same}", flush=True)
    if args.engine_lengths:
        engine_prefill(libs, args.model, [int(n) for n in args.engine_lengths.split(",")], args.runs)


if __name__ == "__main__":
    main()
