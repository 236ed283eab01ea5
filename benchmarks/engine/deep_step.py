"""Cost of a decode step beside a deep prompt: the fused native stack's forward + logits for a few short decode
rows alone, and with P prompt tokens of a long prompt at depth C (against another commit: run it in each commit's
tree, or benchmarks/engine/commit_ab.py).

    python benchmarks/engine/deep_step.py [--model smollm2-135m] [--decodes 3] [--prompt-tokens 1,4,16]
        [--depths 500,2000,4000] [--single-depths 100,4000] [--reps 15]
        [--kv-cache-dtypes bf16,f16]

A case `P@C` is the decode rows (each at context 32) plus P prompt rows whose last sees C positions; `1x@C` is one
decode row alone at context C. The long prompt's K/V is whatever the pool holds (the cost does not depend on the
values). Prints the median milliseconds of each case per library (and KV pool format, `--kv-cache-dtypes`: one pool
each, the sides interleaved case by case) and its cost over the decode rows alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _parse_args() -> argparse.Namespace:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--decodes", type=int, default=3)
    ap.add_argument("--prompt-tokens", default="1,4,16")
    ap.add_argument("--depths", default="500,2000,4000")
    ap.add_argument("--single-depths", default="100,4000")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--kv-cache-dtypes", default="auto", help="KV pool formats to time side by side (bf16,f16)")
    return ap.parse_args()


def _random_pool(model, kv: str, blocks: int, block: int):
    """A KV pool of `blocks` blocks in format `kv` for `model`, filled with random values (seed 0)."""
    from edgeserve.engine.cache.kv_cache import KVPool
    from edgeserve.engine.cache.kv_format import resolve_kv_format

    pool = KVPool(model.config, blocks, block, resolve_kv_format(kv, model.config, model.dtype, model.device))
    g = torch.Generator().manual_seed(0)
    pool.k.copy_(torch.randn(pool.k.shape, generator=g).to(pool.k.dtype))
    pool.v.copy_(torch.randn(pool.v.shape, generator=g).to(pool.v.dtype))
    return pool


def _print_table(times: dict[str, dict[str, list[float]]], sides: list[str]) -> None:
    """Per case and side the median ms and the ms above "decode alone"; with two sides or more, first / last."""
    alone = {side: statistics.median(times["decode alone"][side]) for side in sides}
    first, last = sides[0], sides[-1]
    head = "".join(f"{side + ' ms':>14}{side + ' +ms':>14}" for side in sides)
    print(f"{'case':<16}{head}" + (f"{first + '/' + last:>16}" if len(sides) > 1 else ""))
    for name, per in times.items():
        med = {side: statistics.median(per[side]) for side in sides}
        row = "".join(f"{med[side]:>14.2f}{med[side] - alone[side]:>14.2f}" for side in sides)
        ratio = f"{med[first] / med[last]:>15.2f}x" if len(sides) > 1 else ""
        print(f"{name:<16}{row}{ratio}", flush=True)


def main() -> None:
    args = _parse_args()

    from edgeserve import LLM
    from edgeserve.engine.cache.kv_cache import PagedKVAttention
    from edgeserve.kernels.cpu.native import best_variant, load, threads
    from edgeserve.kernels.torch.paged_attention import AttentionMetadata

    llm = LLM(args.model, kv_cache_gb=0.05)
    model = llm.lm.model
    native = model.native_decoder()
    assert native is not None, "this model does not take the fused native stack here"
    libs = {"this": load(best_variant())}
    block, short_ctx = 16, 32
    depths = [int(x) for x in args.depths.split(",")]
    singles = [int(x) for x in args.single_depths.split(",")]
    per_seq = -(-(max(depths + singles) + 16) // block)
    n_seqs = args.decodes + 1
    pools = {kv: _random_pool(model, kv, n_seqs * per_seq, block) for kv in args.kv_cache_dtypes.split(",")}
    sides = {(f"{lib}/{kv}" if len(pools) > 1 else lib): (lib, kv) for lib in libs for kv in pools}
    tables = [[i * per_seq + j for j in range(per_seq)] for i in range(n_seqs)]
    long = args.decodes

    def slot(seq: int, p: int) -> int:
        return tables[seq][p // block] * block + p % block

    def case(prompt: int, depth: int, decodes: int, decode_ctx: int):
        """(ids, positions, metadata) of one step: `decodes` decode rows at decode_ctx, then `prompt` rows of the
        long sequence ending at depth."""
        q_lens = [1] * decodes + ([prompt] if prompt else [])
        s_lens = [decode_ctx] * decodes + ([depth] if prompt else [])
        pos = [decode_ctx - 1] * decodes + list(range(depth - prompt, depth))
        slots = [slot(i, decode_ctx - 1) for i in range(decodes)] + [slot(long, p) for p in range(depth - prompt, depth)]
        seqs = list(range(decodes)) + ([long] if prompt else [])
        meta = AttentionMetadata.build(q_lens, s_lens, [tables[s] for s in seqs], slots)
        return torch.randint(100, 1000, (len(pos),)), torch.tensor(pos), meta

    cases = {"decode alone": case(0, 0, args.decodes, short_ctx)}
    for c in depths:
        for p in (int(x) for x in args.prompt_tokens.split(",")):
            cases[f"+{p}@{c}"] = case(p, c, args.decodes, short_ctx)
    for c in singles:
        cases[f"1x@{c}"] = case(0, 0, 1, c)
    print(f"{args.model}, variant {best_variant()}, {threads()} threads, {args.decodes} decode rows at {short_ctx}")
    times: dict[str, dict[str, list[float]]] = {name: {side: [] for side in sides} for name in cases}
    for rep in range(args.reps + 1):  # the first round warms up
        for name, (ids, pos, meta) in cases.items():
            for side, (lib, kv) in sides.items():
                native.lib = libs[lib]
                start = time.perf_counter()
                model.logits(model.forward(ids, pos, PagedKVAttention(pools[kv], meta))[-4:])
                if rep:
                    times[name][side].append((time.perf_counter() - start) * 1e3)
    _print_table(times, list(sides))


if __name__ == "__main__":
    main()
