"""edgeserve vs llama.cpp's server on the same GGUF and workloads, alternating A/B over rounds, plus a greedy
correctness cross-check. `benchmarks/serve/compare.py` is the command line."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import venv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import anyio
import httpx

from edgeserve.bench.client import RequestResult, stream_completion
from edgeserve.bench.runner import LoadLevel, run_level
from edgeserve.bench.servers import (EXTRA_BODY, GREEDY_BODY, TOKEN_ID_PROMPTS, ServerError, ServerProcess,
                                     detect_kind, free_port, served_model, start_edgeserve, start_server, stop_server)
from edgeserve.bench.stats import decode_tokens_per_s, request_times
from edgeserve.bench.workloads import RequestSpec, TokenSource
from edgeserve.errors import EdgeserveError, one_line_parse_errors, run_reporting_errors

import numpy as np


@dataclass
class Peer:
    """A running server in the comparison and how to talk to it."""

    label: str  # "edgeserve" or "llama.cpp"
    kind: str  # a key of servers.EXTRA_BODY
    server: ServerProcess
    model: str | None
    tokens: TokenSource  # token-id prompts where the kind takes them, else text

    @property
    def url(self) -> str:
        return self.server.url


@dataclass
class Settings:
    """Sizes of the published workloads (full) or of --quick."""

    rounds: int = 3
    decode_tokens: int = 128
    decode_requests: int = 3
    agg_levels: tuple[int, ...] = (4, 8)
    agg_tokens: int = 128
    agg_requests_per_slot: int = 2
    ttft_prompt: int = 1000
    long_prompt: int = 4000
    short_tokens: int = 32
    short_requests: int = 3
    check_tokens: int = 32

    @classmethod
    def quick(cls) -> "Settings":
        return cls(rounds=2, decode_tokens=32, decode_requests=1, agg_tokens=16, agg_requests_per_slot=1,
                   ttft_prompt=256, long_prompt=1000, short_tokens=16, short_requests=2, check_tokens=16)


@dataclass
class Metric:
    """One published figure: per-round values for each server, and which way is better."""

    workload: str
    name: str
    higher_is_better: bool
    values: dict[str, list[float]] = field(default_factory=dict)

    def median(self, label: str) -> float | None:
        v = [x for x in self.values.get(label, []) if x is not None]
        return statistics.median(v) if v else None


SHORT_PROMPT = 16


def llama_server_command(binary: str, model_path: str, port: int, parallel: int, ctx_per_slot: int,
                         threads: int) -> list[str]:
    """llama-server's command line: loopback, `parallel` slots with continuous batching, a total context of
    `parallel * ctx_per_slot` (llama-server splits -c over its slots), `threads` threads."""
    return [binary, "-m", model_path, "--host", "127.0.0.1", "--port", str(port), "--parallel", str(parallel),
            "-c", str(parallel * ctx_per_slot), "--cont-batching", "-t", str(threads), "-tb", str(threads),
            "--no-webui"]


def llama_cpp_python_venv(cache: Path | None = None) -> Path:
    """A virtual environment with llama-cpp-python[server] under the edgeserve cache folder (made once);
    returns its python."""
    from edgeserve.registry.paths import edgeserve_home

    root = cache or edgeserve_home() / "bench" / "llama-cpp-python-venv"
    py = root / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", "import llama_cpp.server"], capture_output=True).returncode == 0:
        return py
    print(f"compare: installing llama-cpp-python[server] into {root} (once; it builds llama.cpp, minutes)",
          file=sys.stderr, flush=True)
    venv.create(root, with_pip=True, clear=True)
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "llama-cpp-python[server]"])
    if r.returncode != 0:
        raise ServerError(f"pip could not install llama-cpp-python[server] into {root}")
    return py


def llama_cpp_python_command(python: str, model_path: str, port: int, ctx: int, threads: int) -> list[str]:
    """`python -m llama_cpp.server` on loopback; it serves one request at a time, so a new request must not
    cancel the running stream (--interrupt_requests False)."""
    return [python, "-m", "llama_cpp.server", "--model", model_path, "--host", "127.0.0.1", "--port", str(port),
            "--n_ctx", str(ctx), "--n_threads", str(threads), "--n_threads_batch", str(threads),
            "--interrupt_requests", "False"]


def start_peer(args: argparse.Namespace, model_path: str, ctx_per_slot: int, tokenizer) -> Peer:
    """Start llama.cpp's server (the --llama-server binary, else llama-cpp-python in its own venv)."""
    port = free_port()
    if args.llama_server:
        if not os.path.isfile(args.llama_server) or not os.access(args.llama_server, os.X_OK):
            raise ServerError(f"--llama-server {args.llama_server} is not an executable file")
        cmd = llama_server_command(args.llama_server, model_path, port, args.max_seqs, ctx_per_slot, args.threads)
        kind, health = "llama-server", "/health"
    else:
        py = llama_cpp_python_venv()
        cmd = llama_cpp_python_command(str(py), model_path, port, ctx_per_slot, args.threads)
        kind, health = "llama-cpp-python", "/v1/models"
    print(f"compare: starting llama.cpp: {' '.join(cmd)}", file=sys.stderr, flush=True)
    server = start_server("llama.cpp", cmd, port, health, args.server_timeout, log_dir=args.log_dir)
    probed = detect_kind(server.url)  # what actually answers decides the request fields it is sent
    kind = probed if probed != "openai" else kind
    return Peer("llama.cpp", kind, server, served_model(server.url), TokenSource(tokenizer, kind in TOKEN_ID_PROMPTS))


def start_ours(args: argparse.Namespace, model_path: str, tokenizer) -> Peer:
    """Start edgeserve with the same --max-seqs and thread count."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    extra = ["--max-model-len", str(args.max_model_len)] if args.max_model_len else []
    print(f"compare: starting edgeserve --max-seqs {args.max_seqs} (OMP_NUM_THREADS={args.threads})",
          file=sys.stderr, flush=True)
    server = start_edgeserve(model_path, args.max_seqs, extra, args.server_timeout, env, args.log_dir)
    return Peer("edgeserve", "edgeserve", server, served_model(server.url), TokenSource(tokenizer, True))


async def _level(peer: Peer, specs: list[RequestSpec], concurrency: int) -> list[RequestResult]:
    r = await run_level(peer.url, specs, LoadLevel(concurrency=concurrency), peer.model, EXTRA_BODY[peer.kind],
                        progress=False)
    bad = [x for x in r.results if not x.ok]
    if bad:
        raise EdgeserveError(f"{peer.label}: {len(bad)} request(s) failed: {bad[0].error}")
    return r.results


def _specs(peer: Peer, n: int, prompt_tokens: int, max_tokens: int, seed: int) -> list[RequestSpec]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p = peer.tokens.prompt(prompt_tokens, rng)
        out.append(RequestSpec(p, peer.tokens.length(p), max_tokens))
    return out


async def w_decode(peer: Peer, s: Settings, seed: int) -> dict[str, float | None]:
    """Single-stream decode tokens/s: concurrency 1, short prompt, `decode_tokens` output tokens."""
    res = await _level(peer, _specs(peer, s.decode_requests, SHORT_PROMPT, s.decode_tokens, seed), 1)
    return {"decode tokens/s, 1 stream": decode_tokens_per_s(res)}


async def w_aggregate(peer: Peer, s: Settings, seed: int) -> dict[str, float | None]:
    """Aggregate output tokens/s with 4 and 8 requests in flight."""
    out: dict[str, float | None] = {}
    for c in s.agg_levels:
        specs = _specs(peer, c * s.agg_requests_per_slot, SHORT_PROMPT, s.agg_tokens, seed + c)
        r = await run_level(peer.url, specs, LoadLevel(concurrency=c), peer.model, EXTRA_BODY[peer.kind],
                            progress=False)
        if r.summary.errors:
            raise EdgeserveError(f"{peer.label}: {r.summary.errors} request(s) failed: {r.summary.error_messages}")
        out[f"output tokens/s, {c} concurrent"] = r.summary.output_tokens_per_s
    return out


async def w_ttft(peer: Peer, s: Settings, seed: int) -> dict[str, float | None]:
    """TTFT of a fresh `ttft_prompt`-token prompt (cold), then of the same prompt again (prefix cached)."""
    spec = _specs(peer, 1, s.ttft_prompt, 4, seed)
    cold = request_times(await _level(peer, spec, 1)).ttft[0]
    warm = request_times(await _level(peer, spec, 1)).ttft[0]
    return {f"TTFT ms, {s.ttft_prompt}-token prompt, cold": cold * 1000,
            f"TTFT ms, {s.ttft_prompt}-token prompt, cached": warm * 1000}


async def w_prefill_interference(peer: Peer, s: Settings, seed: int) -> dict[str, float | None]:
    """p99 TPOT of short requests alone, and while one `long_prompt`-token prompt is being prefilled."""
    alone = await _level(peer, _specs(peer, s.short_requests, SHORT_PROMPT, s.short_tokens, seed), s.short_requests)
    long_spec = _specs(peer, 1, s.long_prompt, 4, seed + 1)
    shorts = _specs(peer, s.short_requests, SHORT_PROMPT, s.short_tokens, seed + 2)
    loaded: list[RequestResult] = []

    async with anyio.create_task_group() as tg:
        tg.start_soon(_level, peer, long_spec, 1)
        await anyio.sleep(0.05)  # the long prompt is in; the short ones arrive during its prefill

        async def run_shorts() -> None:
            loaded.extend(await _level(peer, shorts, s.short_requests))

        tg.start_soon(run_shorts)

    def p99(rs: list[RequestResult]) -> float | None:
        t = request_times(rs).tpot
        t = t[~np.isnan(t)]
        return float(np.percentile(t, 99) * 1000) if t.size else None

    return {"TPOT p99 ms, short requests, unloaded": p99(alone),
            f"TPOT p99 ms, short requests, during a {s.long_prompt}-token prefill": p99(loaded)}


WORKLOADS: list[tuple[str, Callable]] = [("decode", w_decode), ("aggregate", w_aggregate), ("ttft", w_ttft),
                                         ("prefill-interference", w_prefill_interference)]


def higher_is_better(name: str) -> bool:
    """tokens/s: higher is better; ms: lower is better."""
    return "tokens/s" in name


def run_rounds(peers: list[Peer], s: Settings, workloads: list[str]) -> list[Metric]:
    """Each workload, round by round, the servers alternating who goes first (A/B, B/A, ...)."""
    metrics: dict[str, Metric] = {}
    for wi, (wname, fn) in enumerate(WORKLOADS):
        if wname not in workloads:
            continue
        for rnd in range(s.rounds):
            order = peers if rnd % 2 == 0 else list(reversed(peers))
            for peer in order:
                seed = 1000 * rnd + 17 * wi + 7  # the same prompts for both servers in a round, new each round
                print(f"compare: round {rnd + 1}/{s.rounds} {wname} on {peer.label}", file=sys.stderr, flush=True)
                values = anyio.run(fn, peer, s, seed)
                for name, v in values.items():
                    m = metrics.setdefault(name, Metric(wname, name, higher_is_better(name)))
                    m.values.setdefault(peer.label, []).append(v)
    return list(metrics.values())


@dataclass
class CheckResult:
    """Greedy outputs of both servers on one prompt: identical, or where they first differ."""

    prompt: str
    identical: bool
    first_diff_token: int | None = None
    ours: str = ""
    theirs: str = ""


GREEDY_PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,"]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where `a` and `b` differ (the shorter length if one is a prefix), None if equal."""
    n = min(len(a), len(b))
    diff = np.nonzero(np.asarray(a[:n]) != np.asarray(b[:n]))[0]
    if diff.size:
        return int(diff[0])
    return None if len(a) == len(b) else n


async def _greedy(peer: Peer, prompt: str, max_tokens: int) -> str:
    async with httpx.AsyncClient(timeout=600) as client:
        r = await stream_completion(client, peer.url, RequestSpec(prompt, 0, max_tokens), peer.model,
                                    {"temperature": 0.0, **GREEDY_BODY[peer.kind]})
    if not r.ok:
        raise EdgeserveError(f"{peer.label}: greedy request failed: {r.error}")
    return r.text


def cross_check(ours: Peer, theirs: Peer, tokenizer, max_tokens: int) -> list[CheckResult]:
    """Greedy (temperature 0; repeat_penalty 1.0 for llama.cpp) completions of GREEDY_PROMPTS on both servers,
    compared token by token (texts tokenized with the model's tokenizer)."""
    out = []
    for prompt in GREEDY_PROMPTS:
        a = anyio.run(_greedy, ours, prompt, max_tokens)
        b = anyio.run(_greedy, theirs, prompt, max_tokens)
        ia = tokenizer.encode(a, add_special_tokens=False)
        ib = tokenizer.encode(b, add_special_tokens=False)
        i = None if a == b else first_difference(ia, ib)
        if a != b and i is None:
            i = 0
        if i is None:
            out.append(CheckResult(prompt, True, None, a, b))
        else:
            lo = max(0, i - 8)
            out.append(CheckResult(prompt, False, i, tokenizer.decode(ia[lo:i + 8]), tokenizer.decode(ib[lo:i + 8])))
    return out


def format_results(metrics: list[Metric], checks: list[CheckResult], labels: tuple[str, str]) -> str:
    """The ratio table (medians over rounds) and the correctness lines."""
    a, b = labels
    head = f"{'figure':<58} {a:>12} {b:>12} {a + '/' + b:>20}  better"
    lines = [head, "-" * len(head)]
    for m in metrics:
        ma, mb = m.median(a), m.median(b)
        ratio = ma / mb if ma is not None and mb else None
        lines.append(f"{m.name:<58} {_n(ma):>12} {_n(mb):>12} {_n(ratio, '{:.2f}x'):>20}  "
                     f"{'higher' if m.higher_is_better else 'lower'}")
    lines.append("(medians over rounds; ratio = edgeserve / llama.cpp)")
    for c in checks:
        if c.identical:
            lines.append(f"greedy {c.prompt!r}: identical")
        else:
            lines.append(f"greedy {c.prompt!r}: first differs at token {c.first_diff_token}: "
                         f"edgeserve {c.ours!r} vs llama.cpp {c.theirs!r}")
    return "\n".join(lines)


def _n(v: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def build_parser() -> argparse.ArgumentParser:
    """compare.py's flags."""
    p = argparse.ArgumentParser(prog="compare.py", description="edgeserve vs llama.cpp's server, same GGUF, "
                                                                "alternating A/B rounds")
    p.add_argument("--model", "-m", default=None, help="a GGUF (catalog name or path; default smollm2-135m)")
    p.add_argument("--llama-server", default=None, metavar="PATH",
                   help="llama.cpp's llama-server binary (default: llama-cpp-python[server] in its own venv)")
    p.add_argument("--max-seqs", type=int, default=8, help="edgeserve --max-seqs = llama-server --parallel")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for both (default: all)")
    p.add_argument("--rounds", type=int, default=None, help="A/B rounds (default 3, --quick 2)")
    p.add_argument("--quick", action="store_true", help="small counts, to check the script works")
    p.add_argument("--workloads", default=",".join(w for w, _ in WORKLOADS),
                   help="comma list of: " + ", ".join(w for w, _ in WORKLOADS))
    p.add_argument("--no-check", action="store_true", help="skip the greedy correctness cross-check")
    p.add_argument("--max-model-len", type=int, default=None, help="edgeserve --max-model-len")
    p.add_argument("--server-timeout", type=float, default=300.0, help="seconds each server has to become healthy")
    p.add_argument("--log-dir", default=None, help="where the servers' logs go (default: a temporary folder)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    """The comparison; exit status 1 with one line on any error, both servers stopped whatever happens."""
    p = build_parser()
    one_line_parse_errors("compare", p)
    args = p.parse_args(argv)
    peers: list[Peer] = []
    try:
        return run_reporting_errors("compare", lambda: _run(args, peers))
    finally:
        for peer in peers:
            stop_server(peer.server)


def _run(args: argparse.Namespace, peers: list[Peer]) -> int:
    from edgeserve.bench.command import load_tokenizer
    from edgeserve.registry import DEFAULT_MODEL

    s = Settings.quick() if args.quick else Settings()
    if args.rounds:
        s.rounds = args.rounds
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = set(workloads) - {w for w, _ in WORKLOADS}
    if unknown:
        raise EdgeserveError(f"unknown workload(s) {sorted(unknown)}; choose from {[w for w, _ in WORKLOADS]}")
    if args.max_seqs < max(s.agg_levels):
        s.agg_levels = tuple(c for c in s.agg_levels if c <= args.max_seqs) or (args.max_seqs,)
    tokenizer, source = load_tokenizer(args.model or DEFAULT_MODEL)
    if source.kind != "gguf":
        raise EdgeserveError("the comparison needs a GGUF model (llama.cpp reads only GGUF)")
    model_path = str(source.path)
    need = max(s.long_prompt, s.ttft_prompt) + max(s.decode_tokens, s.agg_tokens, s.check_tokens) + 64
    ctx_per_slot = -(-need // 256) * 256  # per-slot context, a multiple of 256
    peers.append(start_peer(args, model_path, ctx_per_slot, tokenizer))
    peers.append(start_ours(args, model_path, tokenizer))
    ours, theirs = peers[1], peers[0]
    print(f"compare: llama.cpp options: {' '.join(theirs.server.cmd[1:])}", file=sys.stderr, flush=True)
    for peer in (ours, theirs):  # load the models (edgeserve loads lazily); not measured
        anyio.run(_level, peer, _specs(peer, 1, 8, 4, 99), 1)
    checks = [] if args.no_check else cross_check(ours, theirs, tokenizer, s.check_tokens)
    metrics = run_rounds([ours, theirs], s, workloads)
    print(f"model {model_path}; edgeserve --max-seqs {args.max_seqs}, llama.cpp ({theirs.kind}): "
          f"{' '.join(theirs.server.cmd[1:])}; {args.threads} threads each; {s.rounds} rounds")
    print(format_results(metrics, checks, (ours.label, theirs.label)))
    if args.json:
        doc: dict[str, Any] = {
            "model": model_path, "llama_cpp_kind": theirs.kind, "llama_cpp_command": theirs.server.cmd,
            "max_seqs": args.max_seqs, "threads": args.threads, "rounds": s.rounds, "quick": args.quick,
            "metrics": [{"workload": m.workload, "name": m.name, "higher_is_better": m.higher_is_better,
                         "values": m.values, "median": {k: m.median(k) for k in m.values}} for m in metrics],
            "greedy_check": [c.__dict__ for c in checks]}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0
