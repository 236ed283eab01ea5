"""Many LoRA adapters batched in one step (issue 40): aggregate output tokens/s of 8 concurrent requests over 4
different rank-16 adapters vs the same 8 on the base alone, on edgeserve and on llama-server (which takes the
adapters with --lora and a per-request `lora` list), alternating A/B rounds; plus a greedy cross-check of one
adapter on both servers (edgeserve reads the PEFT folder, llama-server the GGUF file of the same weights).

    python benchmarks/serve/lora_throughput.py --llama-server /path/to/llama-server --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from edgeserve.bench.client import RequestResult, stream_completion
from edgeserve.bench.compare import first_difference, llama_server_command
from edgeserve.bench.random_lora import PROJECTIONS, random_pairs, write_gguf_lora, write_peft
from edgeserve.bench.servers import (EXTRA_BODY, free_port, served_model, start_edgeserve, start_server,
                                     stop_server)
from edgeserve.bench.workloads import RequestSpec, TokenSource


def write_adapters(config, folder: Path, n: int, rank: int, targets: tuple[str, ...]) -> list[tuple[Path, Path]]:
    """n random rank-`rank` adapters on the `targets` projections: (PEFT folder, GGUF file) each."""
    out = []
    for i in range(n):
        pairs = random_pairs(config, rank, seed=100 + i, targets=targets, std=0.04)
        out.append((write_peft(folder / f"peft{i}", pairs, rank, 2.0 * rank),
                    write_gguf_lora(folder / f"lora{i}.gguf", pairs, 2.0 * rank, config, config.architecture)))
    return out


async def burst(url: str, bodies: list[tuple[RequestSpec, str | None, dict]]) -> tuple[float, list[RequestResult]]:
    """All requests at once; aggregate output tokens/s (tokens over first start to last end) and the results."""
    async with httpx.AsyncClient(timeout=600) as client:
        results = await asyncio.gather(*[stream_completion(client, url, spec, model, extra)
                                         for spec, model, extra in bodies])
    bad = [r for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} request(s) failed: {bad[0].error}")
    wall = max(r.end for r in results) - min(r.start for r in results)
    tokens = sum(r.completion_tokens or r.chunks for r in results)
    return tokens / wall, results


def workload(server: str, mixed: bool, specs: list[RequestSpec], n_adapters: int,
             base: str | None) -> list[tuple[RequestSpec, str | None, dict]]:
    """Request i runs adapter i % n_adapters (mixed) or none (`base`: the served model's name): by model name on
    edgeserve, by `lora` on llama-server."""
    out = []
    for i, spec in enumerate(specs):
        extra = dict(EXTRA_BODY[server])
        model = None
        if server == "edgeserve":
            model = f"a{i % n_adapters}" if mixed else base
        elif mixed:
            extra["lora"] = [{"id": i % n_adapters, "scale": 1.0}]
        out.append((spec, model, extra))
    return out


async def greedy(url: str, server: str, prompt: list[int], tokens: int, model: str | None = "a0") -> str:
    """Greedy text through adapter a0 (or the base: `model` None on llama-server, the base's name on edgeserve)."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    if server == "edgeserve":
        body["model"] = model
    elif model == "a0":
        body |= {"lora": [{"id": 0, "scale": 1.0}], "top_k": 1, "repeat_penalty": 1.0, "n_probs": 0}
    async with httpx.AsyncClient(timeout=600) as c:
        r = await c.post(url + "/v1/completions", json=body)
        r.raise_for_status()
        return r.json()["choices"][0]["text"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-server", default=None, help="llama-server binary (omit: edgeserve only)")
    p.add_argument("--model", default=None, help="GGUF model (default: the default model)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--requests", type=int, default=8, help="concurrent requests (and --max-seqs / --parallel)")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default="all", help="all (every attention and MLP projection) or a comma list, "
                                                     "e.g. q_proj,v_proj (PEFT's default for Llama)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from edgeserve.bench.command import load_tokenizer
    from edgeserve.models.load import load_model
    from edgeserve.registry import DEFAULT_MODEL

    tokenizer, source = load_tokenizer(args.model or DEFAULT_MODEL)
    config = load_model(source, dtype="bfloat16").config
    tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    targets = PROJECTIONS if args.targets == "all" else tuple(t.strip() for t in args.targets.split(","))
    adapters = write_adapters(config, tmp, args.adapters, args.rank, targets)
    rng = np.random.default_rng(0)
    tokens = TokenSource(tokenizer, True)
    servers = {}
    try:
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        flags = [f for i, (peft, _) in enumerate(adapters) for f in ("--lora", f"a{i}={peft}")]
        servers["edgeserve"] = start_edgeserve(str(source.path), args.requests,
                                               [*flags, "--max-loras", str(args.adapters)], 300, env)
        if args.llama_server:
            port = free_port()
            cmd = llama_server_command(args.llama_server, str(source.path), port, args.requests,
                                       args.prompt_tokens + args.tokens + 64, args.threads)
            cmd += ["--lora", ",".join(str(g) for _, g in adapters), "--lora-init-without-apply"]
            servers["llama-server"] = start_server("llama-server", cmd, port, "/health", 300)
        bases = {name: served_model(s.url) for name, s in servers.items()}
        prompt = tokens.prompt(32, rng)
        checks = {name: asyncio.run(greedy(s.url, name, prompt, 32)) for name, s in servers.items()}
        base_text = asyncio.run(greedy(servers["edgeserve"].url, "edgeserve", prompt, 32, bases["edgeserve"]))
        warm = [RequestSpec(tokens.prompt(8, rng), 8, 2) for _ in range(args.adapters)]
        for name, s in servers.items():  # every adapter loaded and every server warm: not measured
            asyncio.run(burst(s.url, workload(name, True, warm, args.adapters, bases[name])))
            asyncio.run(burst(s.url, workload(name, False, warm, args.adapters, bases[name])))
        values: dict[str, list[float]] = {}
        for rnd in range(args.rounds):
            specs = [RequestSpec(tokens.prompt(args.prompt_tokens, rng), args.prompt_tokens, args.tokens)
                     for _ in range(args.requests)]
            order = list(servers) if rnd % 2 == 0 else list(reversed(servers))
            for name in order:
                for mixed in ((False, True) if rnd % 2 == 0 else (True, False)):
                    label = f"{name} {'mixed' if mixed else 'base'}"
                    tps, _ = asyncio.run(burst(servers[name].url, workload(name, mixed, specs, args.adapters,
                                                                         bases[name])))
                    values.setdefault(label, []).append(tps)
                    print(f"round {rnd + 1}: {label}: {tps:.1f} tokens/s", file=sys.stderr, flush=True)
    finally:
        for s in servers.values():
            stop_server(s)
    med = {k: statistics.median(v) for k, v in values.items()}
    print(f"{args.requests} concurrent requests x {args.tokens} tokens, {args.adapters} rank-{args.rank} adapters on "
          f"{','.join(targets)}, {args.threads} threads, {args.rounds} rounds (median aggregate output tokens/s)")
    for k, v in med.items():
        print(f"  {k:24s} {v:8.1f}   ({', '.join(f'{x:.1f}' for x in values[k])})")
    ratios = {"edgeserve mixed / edgeserve base": med["edgeserve mixed"] / med["edgeserve base"]}
    if "llama-server mixed" in med:
        ratios["llama-server mixed / llama-server base"] = med["llama-server mixed"] / med["llama-server base"]
        ratios["edgeserve mixed / llama-server mixed"] = med["edgeserve mixed"] / med["llama-server mixed"]
    for k, v in ratios.items():
        print(f"  {k:40s} {v:.2f}x")
    same = len(set(checks.values())) == 1
    print(f"  greedy check, adapter a0, 32 tokens: {'identical' if same else 'differ'} across servers; "
          f"{'differs from' if base_text != checks['edgeserve'] else 'SAME AS'} the base's text")
    if not same and len(checks) == 2:
        a, b = (tokenizer.encode(t) for t in checks.values())
        print(f"    first difference at token {first_difference(a, b)}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "model": str(source.path), "settings": vars(args),
            "values": values, "median": med, "ratios": ratios, "greedy_texts": checks, "base_text": base_text},
            indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
