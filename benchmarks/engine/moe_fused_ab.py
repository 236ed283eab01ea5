"""A MoE model's step three ways in one process, on one copy of the weights: the per-op path as main had it (torch
router, ExpertGroups, BlockExperts.grouped, torch slot sum), the per-op path with the one-call native MoE layer
(kernels/cpu/src/moe_layer.c), and the whole fused native stack (kernels/cpu/src/layer.c with layer_t.moe).

Fills a paged pool with B sequences of `--context` tokens, then times blocks of decode steps (forward + logits) at
each batch, the sides taking turns (rotating order per block, a pause between blocks); then prompt chunks of
`--prefill` tokens (forward only). Torch's intra-op threads are set as the engine's model runner sets them (1 for a
step of at most SMALL_STEP_ROWS rows). Prints per side the median (ms) and the ratios against main's per-op path, as
JSON, and checks that the fused and per-op native steps give the same logits bit for bit.

    OMP_NUM_THREADS=2 python benchmarks/engine/moe_fused_ab.py -m /work/models/qwen3-30b-a3b-24layers-q4km.gguf \\
        [--batch 1,8] [--context 64] [--prefill 256] [--blocks 8] [--steps 4] [--generate 32 --rounds 3]

`--generate N` then also times whole greedy generations through the engine (1 and 8 prompts), as a server's
requests run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SIDES = ("main per-op", "per-op native moe", "fused")


def set_side(model, side: str) -> None:
    """Point the model at one side's path."""
    model._native = False if side == "fused" else None
    for layer in model.layers:
        if layer.moe is not None:
            layer.moe._native = None if side == "main per-op" else False


def timed(fn, rows: int, blocks: int, steps: int, clock) -> dict[str, list[float]]:
    """Per side, the times (ms) of `steps - 1` calls of fn(side) per block (the first call of a block untimed), with
    torch's intra-op threads as the engine's model runner sets them for a step of `rows` rows."""
    from edgeserve.engine.runner.model_runner import SMALL_STEP_ROWS
    from edgeserve.models.encoder_threads import intra_op_threads

    times: dict[str, list[float]] = {s: [] for s in SIDES}
    with intra_op_threads(1 if rows <= SMALL_STEP_ROWS else None):
        for blk in range(blocks):
            order = SIDES[blk % 3:] + SIDES[:blk % 3]
            for side in order:
                time.sleep(0.05)  # the pool's workers go to sleep between sides
                fn(side)
                for _ in range(steps - 1):
                    t = clock()
                    fn(side)
                    times[side].append((clock() - t) * 1e3)
    return times


def summary(times: dict[str, list[float]]) -> dict:
    med = {s: statistics.median(v) for s, v in times.items()}
    base = med["main per-op"]
    return {"median_ms": {s: round(v, 2) for s, v in med.items()},
            "speedup_vs_main_per_op": {s: round(base / v, 3) for s, v in med.items()}}


def _parse_args() -> argparse.Namespace:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=256, help="prompt chunk (tokens) to time; 0: none")
    ap.add_argument("--blocks", type=int, default=8, help="timed blocks per side and batch")
    ap.add_argument("--steps", type=int, default=4, help="steps per block (the first one is not timed)")
    ap.add_argument("--generate", type=int, default=0,
                    help="also time LLM.generate of this many greedy tokens for 1 and 8 prompts through the engine")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of --generate per side")
    return ap.parse_args()


def main() -> None:
    args = _parse_args()

    import torch

    from edgeserve import LLM
    from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention
    from edgeserve.kernels.cpu import native as cpu_native
    from edgeserve.kernels.torch.paged_attention import AttentionMetadata

    clock = time.perf_counter
    llm = LLM(args.model, kv_cache_gb=0.05)
    model = llm.lm.model
    set_side(model, "fused")
    assert model.native_decoder() is not None, "this model does not take the fused native stack here"
    block = 16
    batches = [int(x) for x in args.batch.split(",")]
    per_seq = -(-(max(args.context, args.prefill) + 2) // block)
    result: dict = {"model": args.model, "context": args.context, "threads": cpu_native.threads(), "decode": {}}
    for b in batches:
        tables = [[i * per_seq + j for j in range(per_seq)] for i in range(b)]
        p = args.context
        ids = torch.randint(100, 1000, (b * p,))
        pos = torch.arange(p).repeat(b)
        slots = [tables[i][q // block] * block + q % block for i in range(b) for q in range(p)]
        pool = KVPool(model.config, b * per_seq, block, model.dtype)
        set_side(model, "fused")
        model.forward(ids, pos, PagedKVAttention(pool, AttentionMetadata.build([p] * b, [p] * b, tables, slots)))
        step_slots = [tables[i][p // block] * block + p % block for i in range(b)]
        step_ids, step_pos = torch.randint(100, 1000, (b,)), torch.full((b,), p)

        def step(side: str) -> torch.Tensor:
            set_side(model, side)
            meta = AttentionMetadata.build([1] * b, [p + 1] * b, tables, step_slots)
            return model.logits(model.forward(step_ids, step_pos, PagedKVAttention(pool, meta)))

        outs = {s: step(s) for s in SIDES}
        result["decode"][b] = {**summary(timed(step, b, args.blocks, args.steps, clock)),
                               "fused_equals_per_op_native": torch.equal(outs["fused"], outs["per-op native moe"])}
        print(json.dumps({f"decode b{b}": result["decode"][b]}), flush=True)
        del pool
    if args.prefill:
        n = args.prefill
        table = [list(range(per_seq))]
        pool = KVPool(model.config, per_seq, block, model.dtype)
        ids, pos = torch.randint(100, 1000, (n,)), torch.arange(n)
        slots = [table[0][q // block] * block + q % block for q in range(n)]

        def chunk(side: str) -> torch.Tensor:
            set_side(model, side)
            return model.forward(ids, pos, PagedKVAttention(pool, AttentionMetadata.build([n], [n], table, slots)))

        outs = {s: chunk(s) for s in SIDES}
        result["prefill"] = {"tokens": n, **summary(timed(chunk, n, max(2, args.blocks // 2), 2, clock)),
                             "fused_equals_per_op_native": torch.equal(outs["fused"], outs["per-op native moe"])}
        print(json.dumps({f"prefill {n}": result["prefill"]}), flush=True)
    if args.generate:
        result["generate"] = generate(llm, model, args.generate, args.rounds)
    print(json.dumps(result))


def generate(llm, model, tokens: int, rounds: int) -> dict:
    """Output tokens/s of LLM.generate (greedy, `tokens` each) for 1 and 8 prompts of 32 random ids, each side in
    turn per round; medians, ratios against main's per-op path, and whether the sides' tokens agree."""
    import torch

    from edgeserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    out: dict = {}
    for n in (1, 8):
        prompts = [torch.randint(100, 1000, (32,)).tolist() for _ in range(n)]
        rates: dict[str, list[float]] = {s: [] for s in SIDES}
        ids: dict[str, list] = {}
        for r in range(rounds):
            for side in SIDES[r % 3:] + SIDES[:r % 3]:
                set_side(model, side)
                time.sleep(0.05)
                t = time.perf_counter()
                done = llm.generate(prompts, params)
                rates[side].append(n * tokens / (time.perf_counter() - t))
                ids[side] = [d.outputs[0].token_ids for d in done]
        med = {s: statistics.median(v) for s, v in rates.items()}
        out[n] = {"tokens_per_s": {s: round(v, 2) for s, v in med.items()},
                  "speedup_vs_main_per_op": {s: round(v / med["main per-op"], 3) for s, v in med.items()},
                  "same_tokens": ids["fused"] == ids["main per-op"] == ids["per-op native moe"]}
        print(json.dumps({f"generate {n} x {tokens}": out[n]}), flush=True)
    return out


if __name__ == "__main__":
    main()
