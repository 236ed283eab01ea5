"""Decode TPOT at depth with a quantized KV cache, edgeserve against llama-server on the same GGUF, in one run:
edgeserve with --kv-cache-dtype auto (bf16) and q8_0, llama-server with -ctk/-ctv q8_0 (flash attention on; by
default as it comes and with --poll 0, which stops its threads busy-waiting: on a shared, oversubscribed machine
busy-waiting threads lose their cores), one request at a time, the servers interleaved round by round.

    python benchmarks/serve/kv_cache_decode.py --llama-server /path/to/llama-server [--model PATH.gguf | NAME]
        [--depths 2048,8192] [--decode 32] [--rounds 3] [--threads 2] [--llama 'q8_0 --poll 0' ...]

`--model` takes a GGUF path or a catalog name whose file is downloaded already (e.g. `gemma3-270m` for Gemma 3
270M; default: the default model's file); both servers load the same file.

Each request is a token-id prompt of (depth - decode) tokens (the same ids every round, so after the first round
both servers reuse the cached prompt and a round costs only its decode) plus `decode` greedy tokens; TPOT is the
mean time between streamed tokens. Prints one JSON line per depth: medians over rounds per server, ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import anyio
import httpx
import torch

from edgeserve.bench.client import stream_completion
from edgeserve.bench.compare import llama_server_command
from edgeserve.bench.servers import (EXTRA_BODY, free_port, served_model, start_edgeserve, start_server,
                                     stop_server)
from edgeserve.bench.workloads import RequestSpec


def model_file(model: str) -> str:
    """The GGUF file `model` names: a path, or a catalog name resolved to its local file."""
    if os.path.exists(model):
        return model
    from edgeserve.registry import resolve

    return str(resolve(model).path)


def tpot_ms(times: list[float]) -> float | None:
    """Mean milliseconds between streamed tokens."""
    return (times[-1] - times[0]) / (len(times) - 1) * 1e3 if len(times) > 1 else None


async def one(url: str, model: str | None, kind: str, prompt: list[int], decode: int) -> float | None:
    async with httpx.AsyncClient() as client:
        r = await stream_completion(client, url, RequestSpec(prompt, len(prompt), decode), model, EXTRA_BODY[kind],
                                    timeout=1800.0)
    if not r.ok:
        raise RuntimeError(f"{url}: {r.error}")
    return tpot_ms(r.chunk_times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", default="")
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/edgeserve/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--depths", default="2048,8192")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--llama", action="append",
                    help="a llama-server variant: its -ctk/-ctv type and extra flags, e.g. 'q8_0 --poll 0' "
                         "(repeatable; default: 'q8_0' and 'q8_0 --poll 0'; 'none': edgeserve only)")
    args = ap.parse_args()
    args.model = model_file(args.model)
    depths = [int(d) for d in args.depths.split(",")]
    ctx = max(depths) + 64
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), EDGESERVE_THREADS=str(args.threads))
    servers = {}
    try:
        for kv in ("auto", "q8_0"):
            extra = ["--kv-cache-dtype", kv, "--kv-cache-gb", str(args.kv_cache_gb), "--max-model-len", str(ctx)]
            servers[f"edgeserve {kv}"] = ("edgeserve", start_edgeserve(args.model, 1, extra, 600, env, args.log_dir))
        for i, variant in enumerate(v for v in args.llama or ["q8_0", "q8_0 --poll 0"] if v != "none"):
            kv, *more = variant.split()
            port = free_port()
            cmd = llama_server_command(args.llama_server, args.model, port, 1, ctx, args.threads)
            cmd += ["-ctk", kv, "-ctv", kv, "-fa", "on", *more]
            servers[f"llama-server {variant}"] = ("llama-server",
                                                  start_server(f"llama-server-{i}", cmd, port, "/health", 600,
                                                               log_dir=args.log_dir))
        models = {name: served_model(s.url) for name, (_, s) in servers.items()}
        vocab_hi = 40000
        for depth in depths:
            g = torch.Generator().manual_seed(depth)
            prompt = torch.randint(100, vocab_hi, (depth - args.decode,), generator=g).tolist()
            tpots: dict[str, list[float]] = {name: [] for name in servers}
            for rnd in range(args.rounds + 1):  # round 0 prefills (and is not counted)
                for name, (kind, s) in servers.items():
                    t = anyio.run(one, s.url, models[name], kind, prompt, args.decode)
                    if rnd and t is not None:
                        tpots[name].append(t)
                    print(f"depth {depth} round {rnd} {name}: {t:.2f} ms", file=sys.stderr, flush=True)
            med = {name: round(statistics.median(v), 2) for name, v in tpots.items()}
            print(json.dumps({"model": os.path.basename(args.model), "depth": depth, "decode": args.decode,
                              "rounds": args.rounds, "tpot_ms_median": med, "tpot_ms_rounds": tpots,
                              "edgeserve_q8_vs_bf16": round(med["edgeserve q8_0"] / med["edgeserve auto"], 3),
                              "edgeserve_q8_vs_each": {name: round(med["edgeserve q8_0"] / m, 3)
                                                       for name, m in med.items()}}), flush=True)
    finally:
        for _, s in servers.values():
            stop_server(s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
