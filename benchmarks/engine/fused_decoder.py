"""The model part of a CPU decode step, fused native stack against the per-op path, in one process.

Loads a model once, fills a paged pool for B sequences of `--context` tokens, then times forward + logits of one
decode row per sequence, alternating the fused stack (kernels.cpu.decoder, one native call for every layer) and
the per-op path (one kernel call per op from Python) rep by rep, so both see the same machine load. Also times the
step's matmuls alone (every layer's weights and the output head at the same batch), the floor both paths share.
With `--prefill N`, also times a cold prompt step of N tokens (forward + the last row's logits), alternated the
same way. Prints medians and minimums (ms) and the ratios, as JSON. A hybrid (Qwen3.5, LFM2, Granite 4 H) runs over a
state pool beside the paged one, each sequence in its own slot (its state advancing step by step, the same work for
both).

    python benchmarks/engine/fused_decoder.py [--model smollm2-135m | GGUF] [--batch 1,8] [--context 128] [--reps 40]
                                       [--prefill 256 --prefill-reps 6] [--kv-cache-gb 0.05]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _parse_args() -> argparse.Namespace:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--prefill", type=int, default=0, help="also time a prompt step of this many tokens")
    ap.add_argument("--prefill-reps", type=int, default=6)
    ap.add_argument("--kv-cache-gb", type=float, default=0.05,
                    help="the LLM's cache budget (a hybrid's must hold one sequence's recurrent state)")
    return ap.parse_args()


def main() -> None:
    args = _parse_args()

    import torch

    from edgeserve import LLM
    from edgeserve.engine.cache.kv_cache import KVPool
    from edgeserve.kernels.torch.paged_attention import AttentionMetadata

    llm = LLM(args.model, kv_cache_gb=args.kv_cache_gb)
    model = llm.lm.model
    assert model.native_decoder() is not None, "this model does not take the fused native stack here"
    block = 16
    per_seq = -(-(args.context + 1) // block)
    result: dict = {"model": args.model, "context": args.context, "batches": {}}
    for b in (int(x) for x in args.batch.split(",")):
        pool = KVPool(model.config, b * per_seq, block, model.dtype)
        tables = [[i * per_seq + j for j in range(per_seq)] for i in range(b)]
        # fill the context with a prompt step (fused; both paths write the same K/V)
        ids = torch.randint(100, 1000, (b * args.context,))
        pos = torch.arange(args.context).repeat(b)
        slots = [tables[i][p // block] * block + p % block for i in range(b) for p in range(args.context)]
        meta = AttentionMetadata.build([args.context] * b, [args.context] * b, tables, slots)
        states = state_pool(model, b)
        model.forward(ids, pos, attention(pool, meta, states, [args.context] * b))
        p = args.context
        step_slots = [tables[i][p // block] * block + p % block for i in range(b)]
        ids, pos = torch.randint(100, 1000, (b,)), torch.full((b,), p)

        def step(fused: bool) -> float:
            model._native = False if fused else None
            meta = AttentionMetadata.build([1] * b, [p + 1] * b, tables, step_slots)
            start = time.perf_counter()
            model.logits(model.forward(ids, pos, attention(pool, meta, states, [1] * b)))
            return (time.perf_counter() - start) * 1e3

        matmuls = matmul_timer(model, b, b)
        times: dict[str, list[float]] = {"fused": [], "per_op": [], "matmuls_only": []}
        for r in range(args.reps + 2):
            got = {"fused": step(True), "per_op": step(False), "matmuls_only": matmuls()}
            if r >= 2:  # warm-up
                for k, v in got.items():
                    times[k].append(v)
        med = {k: statistics.median(v) for k, v in times.items()}
        low = {k: min(v) for k, v in times.items()}
        result["batches"][b] = {
            "median_ms": {k: round(v, 2) for k, v in med.items()},
            "min_ms": {k: round(v, 2) for k, v in low.items()},
            "per_op_over_fused_median": round(med["per_op"] / med["fused"], 2),
            "fused_over_matmuls_median": round(med["fused"] / med["matmuls_only"], 2),
            "per_op_over_matmuls_median": round(med["per_op"] / med["matmuls_only"], 2),
        }
        print(json.dumps({b: result["batches"][b]}), flush=True)
    if args.prefill:
        result["prefill"] = prefill(model, args.prefill, args.prefill_reps, block)
        print(json.dumps({"prefill": result["prefill"]}), flush=True)
    model._native = False
    print(json.dumps(result, indent=1))


def prefill(model, n: int, reps: int, block: int) -> dict:
    """Medians and minimums (ms) of a cold prompt step of n tokens, fused and per-op, alternated rep by rep."""
    import torch

    from edgeserve.engine.cache.kv_cache import KVPool
    from edgeserve.kernels.torch.paged_attention import AttentionMetadata

    blocks = -(-n // block)
    pool = KVPool(model.config, blocks, block, model.dtype)
    states = state_pool(model, 1)
    ids, pos = torch.randint(100, 1000, (n,)), torch.arange(n)

    def step(fused: bool) -> float:
        model._native = False if fused else None
        meta = AttentionMetadata.build([n], [n], [list(range(blocks))], list(range(n)))
        start = time.perf_counter()
        if states is not None:  # a cold prompt: from a zero state
            for t in states.tensors.values():
                t.zero_()
        model.logits(model.forward(ids, pos, attention(pool, meta, states, [n]))[-1:])
        return (time.perf_counter() - start) * 1e3

    matmuls = matmul_timer(model, n, 1)
    times: dict[str, list[float]] = {"fused": [], "per_op": [], "matmuls_only": []}
    for r in range(reps + 1):
        got = {"fused": step(True), "per_op": step(False), "matmuls_only": matmuls()}
        if r >= 1:  # warm-up
            for k, v in got.items():
                times[k].append(v)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"tokens": n, "median_ms": {k: round(v, 1) for k, v in med.items()},
            "min_ms": {k: round(min(v), 1) for k, v in times.items()},
            "per_op_over_fused_median": round(med["per_op"] / med["fused"], 2),
            "fused_over_matmuls_median": round(med["fused"] / med["matmuls_only"], 2)}


def state_pool(model, num_seqs: int):
    """A hybrid model's recurrent-state pool with a slot per sequence, all taken (None for other models)."""
    from edgeserve.engine.cache.state_pool import StatePool, state_spec_for

    c = model.config
    if not getattr(c, "is_hybrid", False):
        return None
    pool = StatePool(state_spec_for(c), num_seqs)
    for _ in range(num_seqs):
        pool.allocate()
    return pool


def attention(pool, meta, states, query_lens: list[int]):
    """The step's attention over the paged pool, with sequence i's recurrent state in slot i for a hybrid."""
    import itertools

    from edgeserve.engine.cache.kv_cache import PagedKVAttention
    from edgeserve.engine.cache.state_pool import StepStates

    if states is None:
        return PagedKVAttention(pool, meta)
    step = StepStates.build(states, [0, *itertools.accumulate(query_lens)], list(range(len(query_lens))))
    return PagedKVAttention(pool, meta, states=step)


def matmul_timer(model, rows: int, head_rows: int):
    """A function timing (ms) every layer's four main matrices over `rows` rows and the output head over
    `head_rows`: the floor of a step's matmuls both paths share."""
    import torch

    names = ("qkv", "o_proj", "in_proj", "out_proj", "gate_up", "down")  # a hybrid's linear layers: in / out_proj
    # a Mamba-2 hybrid's mixer projections sit in layer.mamba
    parts = [p for layer in model.layers for p in (layer, getattr(layer, "mamba", None)) if p is not None]
    weights = [getattr(p, n) for p in parts for n in names if getattr(p, n, None) is not None]
    xs = {w.in_features: torch.randn(rows, w.in_features).to(model.dtype) for w in weights}
    x_head = torch.randn(head_rows, model.config.hidden_size).to(model.dtype)

    def matmuls() -> float:
        start = time.perf_counter()
        for w in weights:
            w.matmul(xs[w.in_features])
        model.lm_head.matmul(x_head)
        return (time.perf_counter() - start) * 1e3

    return matmuls


if __name__ == "__main__":
    main()
