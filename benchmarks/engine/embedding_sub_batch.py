"""Embedding sub-batch size on the CPU: throughput, and how long a request waits behind an abandoned one.

    python benchmarks/engine/embedding_sub_batch.py --model ~/.cache/edgeserve/models/all-MiniLM-L6-v2 --sizes 2048 16384

For each sub-batch size (EmbeddingEngine.sub_batch_tokens), interleaved over --rounds: (1) the seconds to embed
--inputs inputs of --length tokens in one request; (2) an abandoned request: the same inputs are submitted, the
request is cancelled once its first sub-batch runs, and a one-input request is submitted at once; its latency is
how long the next client waits behind the abandoned work. Prints one JSON object (every sample, medians, ratios
against the first size)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import anyio
import anyio.to_thread

from edgeserve.engine.runner.embedder import EmbeddingEngine
from edgeserve.registry import resolve
from edgeserve.server.config import ServerConfig
from edgeserve.server.model_manager import load_embedder


class Started:
    """Wraps lm.embed: notes when a forward starts."""

    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, batch):
        self.calls += 1
        return self.fn(batch)


async def one_size(lm, size: int, seqs: list[list[int]]) -> tuple[float, float]:
    """(seconds for the whole request, seconds a one-input request waits behind the abandoned one)."""
    engine = EmbeddingEngine(lm, sub_batch_tokens=size)
    probe = lm.embed = Started(lm.embed.fn if isinstance(lm.embed, Started) else lm.embed)
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.run)
        t0 = time.perf_counter()
        await engine.embed(seqs)
        whole = time.perf_counter() - t0
        with anyio.CancelScope() as scope:
            async def abandon() -> None:
                while probe.calls == before:
                    await anyio.sleep(0.005)
                scope.cancel()

            before = probe.calls
            tg.start_soon(abandon)
            await engine.embed(seqs)
        t1 = time.perf_counter()
        await engine.embed(seqs[:1])
        wait = time.perf_counter() - t1
        engine.shutdown()
    return whole, wait


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 16384])
    ap.add_argument("--inputs", type=int, default=256)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    lm = load_embedder(resolve(args.model), ServerConfig())
    seqs = [[101] + [1000 + (i * 7 + j) % 20000 for j in range(args.length - 2)] + [102] for i in range(args.inputs)]
    lm.embed(seqs[:4])  # warm
    samples: dict[int, dict[str, list[float]]] = {s: {"whole": [], "wait": []} for s in args.sizes}
    for r in range(args.rounds):
        for size in (args.sizes if r % 2 == 0 else args.sizes[::-1]):
            whole, wait = anyio.run(one_size, lm, size, seqs)
            samples[size]["whole"].append(round(whole, 3))
            samples[size]["wait"].append(round(wait, 3))
    med = {s: {k: statistics.median(v) for k, v in d.items()} for s, d in samples.items()}
    base = args.sizes[0]
    print(json.dumps({"inputs": args.inputs, "length": args.length, "samples": samples, "medians": med,
                      "ratios_vs_first": {s: {k: round(med[s][k] / med[base][k], 3) for k in ("whole", "wait")}
                                          for s in args.sizes}}, indent=1))


if __name__ == "__main__":
    main()
