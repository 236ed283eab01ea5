"""edgeserve vs llama.cpp's llama-server on one large (MoE) GGUF, one server at a time: for models that two servers
cannot hold in memory at once. Each round starts each server in turn (the order alternating A/B, B/A, ...), times
its load, reads its resident memory, runs the workloads, and stops it before the other starts.

    OMP_NUM_THREADS=2 python benchmarks/serve/moe_compare.py -m /work/models/qwen3-30b-a3b-q4km.gguf \
        --llama-server LLAMA_SERVER --threads 2 --max-seqs 8 --rounds 2 --json OUT.json

Per server and round:
- load: seconds from spawn until /health answers, and until a first 8-token prompt with 4 output tokens has
  completed (edgeserve loads the model on that first request, llama-server before /health; so the second figure is
  the one the two sides are compared on);
- resident memory (the process tree's RSS, and its anonymous / file-backed parts from /proc) after that first
  request and again after the workloads, beside the file's size;
- decode tokens/s, 1 stream (16-token prompts, `--decode-tokens` out, `--decode-requests` of them, median 1/TPOT);
- output tokens/s with `--max-seqs` requests in flight (16-token prompts, `--agg-tokens` out each);
- TTFT of a fresh `--ttft-prompt`-token prompt (cold), then of the same prompt again (prefix cached).
The workloads and their sizes are edgeserve.bench.compare's (benchmarks/serve/compare.py), so figures line up with it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import anyio
import psutil

from edgeserve.bench.compare import Peer, Settings, _level, _specs, start_peer, w_aggregate, w_decode, w_ttft
from edgeserve.bench.servers import served_model, start_edgeserve, stop_server
from edgeserve.bench.workloads import TokenSource


def start_ours(args: argparse.Namespace, model_path: str, tokenizer) -> Peer:
    """edgeserve with the same --max-seqs and thread count (compare.start_ours, plus --kv-cache-gb)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    extra = ["--max-model-len", str(args.max_model_len)] if args.max_model_len else []
    if args.kv_cache_gb is not None:
        extra += ["--kv-cache-gb", str(args.kv_cache_gb)]
    print(f"moe_compare: starting edgeserve --max-seqs {args.max_seqs} {' '.join(extra)} "
          f"(OMP_NUM_THREADS={args.threads})", file=sys.stderr, flush=True)
    server = start_edgeserve(model_path, args.max_seqs, extra, args.server_timeout, env, args.log_dir)
    return Peer("edgeserve", "edgeserve", server, served_model(server.url), TokenSource(tokenizer, True))


def tree_memory(pid: int) -> dict[str, float]:
    """MB of resident memory of `pid` and its children: RSS, and its anonymous and file-backed parts."""
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    out = {"rss_mb": 0.0, "rss_anon_mb": 0.0, "rss_file_mb": 0.0}
    for p in procs:
        try:
            status = Path(f"/proc/{p.pid}/status").read_text()
        except OSError:
            continue
        fields = dict(re.findall(r"^(\w+):\s+(\d+) kB", status, re.M))
        out["rss_mb"] += int(fields.get("VmRSS", 0)) / 1024
        out["rss_anon_mb"] += int(fields.get("RssAnon", 0)) / 1024
        out["rss_file_mb"] += int(fields.get("RssFile", 0)) / 1024
    return out


def kv_lines(log: Path) -> list[str]:
    """The server log's lines about its KV cache size (llama-server prints them at load)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    return [ln.strip() for ln in text.splitlines() if re.search(r"kv.*(size|MiB)|KV", ln)][:8]


def one_run(label: str, args: argparse.Namespace, s: Settings, rnd: int, tokenizer, source) -> dict:
    """Start one server, measure it, stop it."""
    t0 = time.monotonic()
    if label == "llama.cpp":
        peer = start_peer(args, str(source.path), args.ctx_per_slot, tokenizer)
    else:
        peer = start_ours(args, str(source.path), tokenizer)
    try:
        row: dict = {"server": label, "round": rnd, "spawn_to_health_s": time.monotonic() - t0}
        anyio.run(_level, peer, _specs(peer, 1, 8, 4, 99), 1)  # edgeserve loads the model here
        row["spawn_to_first_completion_s"] = time.monotonic() - t0
        row["memory_after_load"] = tree_memory(peer.server.pid)
        for wname, fn in (("decode", w_decode), ("aggregate", w_aggregate), ("ttft", w_ttft)):
            if wname not in args.workloads:
                continue
            print(f"moe_compare: round {rnd + 1} {wname} on {label}", file=sys.stderr, flush=True)
            row.update(anyio.run(fn, peer, s, 1000 * rnd + 7 * len(wname)))
        row["memory_after_workloads"] = tree_memory(peer.server.pid)
        row["kv_log"] = kv_lines(peer.server.log_path)
        row["command"] = peer.server.cmd
        return row
    finally:
        stop_server(peer.server)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", "-m", required=True, help="a GGUF path")
    p.add_argument("--llama-server", required=True, metavar="PATH")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--max-seqs", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--decode-requests", type=int, default=2)
    p.add_argument("--agg-tokens", type=int, default=32)
    p.add_argument("--ttft-prompt", type=int, default=1000)
    p.add_argument("--workloads", default="decode,aggregate,ttft")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="edgeserve --kv-cache-gb")
    p.add_argument("--max-model-len", type=int, default=None, help="edgeserve --max-model-len")
    p.add_argument("--server-timeout", type=float, default=900.0)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--llama-extra", default="", help="more llama-server flags, e.g. '--no-mmap' (appended)")
    p.add_argument("--first", choices=("edgeserve", "llama.cpp"), default="edgeserve")
    p.add_argument("--json", default=None, metavar="FILE")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if args.llama_extra:  # a wrapper that appends the flags to compare.llama_server_command's
        import shlex
        import tempfile

        wrapper = Path(tempfile.mkdtemp(prefix="moe-compare-")) / "llama-server"
        wrapper.write_text(f"#!/bin/sh\nexec {shlex.quote(os.path.abspath(args.llama_server))} \"$@\" "
                           f"{args.llama_extra}\n")
        wrapper.chmod(0o755)
        args.llama_server = str(wrapper)
    s = Settings(rounds=args.rounds, decode_tokens=args.decode_tokens, decode_requests=args.decode_requests,
                 agg_levels=(args.max_seqs,), agg_tokens=args.agg_tokens, agg_requests_per_slot=1,
                 ttft_prompt=args.ttft_prompt)
    args.ctx_per_slot = -(-(args.ttft_prompt + max(args.decode_tokens, args.agg_tokens) + 64) // 256) * 256
    order = [args.first, "llama.cpp" if args.first == "edgeserve" else "edgeserve"]
    file_mb = Path(args.model).stat().st_size / 2**20
    from edgeserve.bench.command import load_tokenizer

    tokenizer, source = load_tokenizer(args.model)
    rows = []
    for rnd in range(args.rounds):
        for label in (order if rnd % 2 == 0 else order[::-1]):
            print(f"moe_compare: round {rnd + 1}/{args.rounds}: starting {label}", file=sys.stderr, flush=True)
            row = one_run(label, args, s, rnd, tokenizer, source)
            print(json.dumps({k: v for k, v in row.items() if k != "command"}), file=sys.stderr, flush=True)
            rows.append(row)
    figures = sorted({k for r in rows for k, v in r.items() if isinstance(v, (int, float)) and k != "round"})
    summary = {}
    for k in figures:
        med = {}
        for label in ("edgeserve", "llama.cpp"):
            v = [r[k] for r in rows if r["server"] == label and r.get(k) is not None]
            med[label] = {"median": float(statistics.median(v)) if v else None, "rounds": [round(float(x), 3) for x in v]}
        e, l_ = med["edgeserve"]["median"], med["llama.cpp"]["median"]
        med["ratio"] = e / l_ if e is not None and l_ else None
        summary[k] = med
    for label in ("edgeserve", "llama.cpp"):
        for when in ("memory_after_load", "memory_after_workloads"):
            v = [r[when]["rss_mb"] for r in rows if r["server"] == label]
            summary[f"{when} rss_mb / file, {label}"] = statistics.median(v) / file_mb if v else None
    print(f"model {args.model} ({file_mb:.0f} MiB); {args.threads} threads each; --max-seqs / --parallel "
          f"{args.max_seqs}; {args.rounds} rounds, one server at a time")
    for k, m in summary.items():
        if isinstance(m, dict):
            print(f"{k:<50} edgeserve {_n(m['edgeserve']['median']):>10} {m['edgeserve']['rounds']}  "
                  f"llama.cpp {_n(m['llama.cpp']['median']):>10} {m['llama.cpp']['rounds']}  ratio {_n(m['ratio'], '{:.2f}x')}")
        else:
            print(f"{k:<50} {_n(m, '{:.2f}x')}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "file_mib": file_mb, "threads": args.threads,
                                               "max_seqs": args.max_seqs, "rounds": rows, "summary": summary},
                                              indent=2, default=str) + "\n")
    return 0


def _n(v, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


if __name__ == "__main__":
    sys.exit(main())
