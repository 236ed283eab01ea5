"""`edgeserve bench`: build the workload, start or find the server, run each load level, report."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

from edgeserve.bench.report import BenchReport, format_table, write_json
from edgeserve.bench.runner import LevelResult, LoadLevel, run_level_sync
from edgeserve.bench.servers import (EXTRA_BODY, TOKEN_ID_PROMPTS, ServerError, detect_kind, served_model,
                                     start_edgeserve, stop_server)
from edgeserve.bench.stats import decode_tokens_per_s
from edgeserve.bench.workloads import (TokenSource, Workload, chat_workload, copy_workload, fixed_workload)
from edgeserve.errors import EdgeserveError


def load_tokenizer(model: str):
    """The tokenizer of a catalog model, .gguf file or HF folder, without loading the weights."""
    from edgeserve.loaders.gguf_file import GGUFFile
    from edgeserve.loaders.tokenizer import tokenizer_from_gguf, tokenizer_from_hf_folder
    from edgeserve.registry import resolve

    source = resolve(model)
    if source.kind == "gguf":
        return tokenizer_from_gguf(GGUFFile(source.path).metadata), source
    return tokenizer_from_hf_folder(source.path), source


def tokenizer_of_served_model(url: str, kind: str, name: str):
    """(tokenizer, source) of the model a server at `url` serves as `name`, when this machine has it (edgeserve's
    /api/show names the path or catalog name it serves; else `name` itself is tried), else (None, None)."""
    from edgeserve.bench.servers import http_post_json
    from edgeserve.registry import resolve

    specs = [name]
    if kind == "edgeserve":
        try:
            _, body = http_post_json(url + "/api/show", {"model": name}, timeout=10.0)
            modelfile = body.get("modelfile", "") if isinstance(body, dict) else ""
            if modelfile.startswith("FROM "):
                specs.insert(0, modelfile[5:].strip())
        except (OSError, ValueError):
            pass
    for spec in specs:
        try:
            resolve(spec, pull_missing=False)
            return load_tokenizer(spec)
        except EdgeserveError:
            continue
    return None, None


def build_workload(args: argparse.Namespace, source: TokenSource, seed: int, num_requests: int | None = None
                   ) -> Workload:
    """The workload the flags ask for, seeded with `seed`."""
    n = num_requests or args.num_requests
    if args.workload == "chat":
        return chat_workload(source, n, seed, args.prompt_tokens, args.max_tokens, args.shared_prefix_tokens)
    if args.workload == "copy":
        return copy_workload(source, n, args.prompt_tokens, args.max_tokens, seed)
    return fixed_workload(source, n, args.prompt_tokens, args.max_tokens, seed, args.shared_prefix_tokens)


def check_args(args: argparse.Namespace) -> list[LoadLevel]:
    """Validate the flags' values together (one-line EdgeserveError); returns the load levels to sweep."""
    for name in ("num_requests", "prompt_tokens", "max_tokens"):
        if getattr(args, name) < 1:
            raise EdgeserveError(f"--{name.replace('_', '-')} must be at least 1")
    if args.shared_prefix_tokens < 0:
        raise EdgeserveError("--shared-prefix-tokens must be 0 or more")
    if args.duration is not None and args.duration <= 0:
        raise EdgeserveError("--duration must be positive")
    if args.concurrency is not None and args.request_rate is not None:
        raise EdgeserveError("give --concurrency or --request-rate, not both")
    if args.roofline and args.url and not args.model:
        raise EdgeserveError("--roofline with --url needs --model (the GGUF the server runs)")
    if not 0.0 <= args.temperature <= 2.0:
        raise EdgeserveError("--temperature must be between 0 and 2")
    if not 0.0 < args.top_p <= 1.0:
        raise EdgeserveError("--top-p must be in (0, 1]")
    if args.mem_bandwidth_gbs is not None and args.mem_bandwidth_gbs <= 0:
        raise EdgeserveError("--mem-bandwidth-gbs must be positive")
    if args.request_rate is not None:
        return [LoadLevel(rate=r) for r in args.request_rate]
    return [LoadLevel(concurrency=c) for c in (args.concurrency or [1])]


def _bench_target(args: argparse.Namespace, model_arg: str | None, tokenizer, source) -> tuple:
    """(url, server kind, served model name, tokenizer, its source, started server or None) of a bench run: the
    --url given, else an edgeserve started on the model."""
    server = None
    if args.url:
        url = args.url.rstrip("/")
    else:
        print(f"edgeserve bench: starting edgeserve on {model_arg} (--max-seqs {args.max_seqs})",
              file=sys.stderr, flush=True)
        server = start_edgeserve(str(source.path), args.max_seqs, timeout=args.server_timeout)
        url = server.url
    try:
        kind = detect_kind(url)
        model_name = args.served_model_name or served_model(url)
        if model_name is None:
            raise EdgeserveError(f"the server at {url} lists no model in /v1/models; pass --served-model-name")
        if tokenizer is None:  # --url without --model: the served model's tokenizer, when this machine has it
            tokenizer, source = tokenizer_of_served_model(url, kind, model_name)
            print(f"edgeserve bench: model {model_name} (from {url}/v1/models)"
                  + ("" if tokenizer is not None else "; its tokenizer is not here, so the prompts are text"),
                  file=sys.stderr, flush=True)
    except BaseException:
        if server is not None:
            stop_server(server)
        raise
    return url, kind, model_name, tokenizer, source, server


def _bench_levels(args: argparse.Namespace, levels: list, tokens: TokenSource, url: str, model_name: str,
                  extra: dict[str, Any]) -> tuple[list[LevelResult], Any]:
    """Warm the server (not measured), then run every load level on fresh prompts; (results, last workload)."""
    if args.warmup:  # load the model (edgeserve loads lazily) and warm caches; not measured
        warm = fixed_workload(tokens, args.warmup, 8, 4, seed=10_000 + args.seed)
        lr = run_level_sync(url, warm.requests, LoadLevel(concurrency=1), model_name, extra, progress=False)
        if not any(r.ok for r in lr.results):
            raise ServerError(f"the server at {url} failed the warm-up request: {lr.results[0].error}")
    results: list[LevelResult] = []
    workload = None
    for i, level in enumerate(levels):
        workload = build_workload(args, tokens, args.seed + i)  # new prompts per level: no cross-level cache
        results.append(run_level_sync(url, workload.requests, level, model_name, extra, duration=args.duration,
                                      seed=args.seed + i, slo_ttft_ms=args.slo_ttft, slo_tpot_ms=args.slo_tpot,
                                      progress=False if args.no_progress else None))
    return results, workload


def _write_report(args: argparse.Namespace, report: BenchReport) -> None:
    """The table on stdout (unless the JSON goes there), the JSON file and the plot asked for."""
    if args.json != "-":
        print(format_table(report))
    if args.json:
        write_json(report, args.json)
    if args.plot:
        from edgeserve.bench.plot import plot_report

        plot_report(report, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)


def run_bench(args: argparse.Namespace) -> int:
    """The `bench` subcommand: returns the exit status (1 when every request failed)."""
    from edgeserve.registry import DEFAULT_MODEL

    levels = check_args(args)
    if args.plot:
        from edgeserve.bench.plot import require_matplotlib

        require_matplotlib()
    model_arg = args.model or (None if args.url else DEFAULT_MODEL)
    tokenizer, source = load_tokenizer(model_arg) if model_arg else (None, None)
    url, kind, model_name, tokenizer, source, server = _bench_target(args, model_arg, tokenizer, source)
    try:
        extra: dict[str, Any] = dict(EXTRA_BODY[kind])
        if args.temperature > 0:  # sampled requests (the body says temperature 0 otherwise)
            extra.update(temperature=args.temperature, top_p=args.top_p)
        want_ids = {"auto": kind in TOKEN_ID_PROMPTS and tokenizer is not None, "ids": True,
                    "text": False}[args.prompt_format]
        if want_ids and tokenizer is None:
            raise EdgeserveError("token-id prompts need --model (its tokenizer builds them)")
        tokens = TokenSource(tokenizer, as_ids=want_ids)
        results, workload = _bench_levels(args, levels, tokens, url, model_name, extra)
        assert workload is not None
        roof = _roofline(args, source, tokens, url, model_name, extra, results) if args.roofline else None
        report = BenchReport(url, kind, model_name, workload.name, workload.prompt_format,
                             {**workload.notes, "num_requests": args.num_requests, "seed": args.seed,
                              "temperature": args.temperature, "top_p": args.top_p}, results, roof)
        _write_report(args, report)
        return 0 if any(lv.summary.completed for lv in results) else 1
    finally:
        if server is not None:
            stop_server(server)


def _roofline(args, source, tokens: TokenSource, url: str, model_name, extra, results: list[LevelResult]):
    """The roofline next to the measured single-stream decode rate (the concurrency-1 level, or a short
    extra single-stream run when the sweep has none)."""
    from edgeserve.bench.roofline import roofline

    if source is None or source.kind != "gguf":
        raise EdgeserveError("--roofline needs a GGUF model (its tensor data size is the weights' bytes)")
    single = [lv for lv in results if lv.level.concurrency == 1]
    if single:
        measured = decode_tokens_per_s(single[0].results)
    else:
        w = build_workload(args, tokens, args.seed + 999, num_requests=min(args.num_requests, 4))
        measured = decode_tokens_per_s(run_level_sync(url, w.requests, LoadLevel(concurrency=1), model_name, extra,
                                                      progress=False).results)
    specs = results[0].results
    ctx = float(np.mean([(r.prompt_tokens or r.expected_prompt_tokens or 0) + r.output_tokens / 2 for r in specs])) \
        if specs else float(args.prompt_tokens + args.max_tokens / 2)
    return roofline(source.path, ctx, args.mem_bandwidth_gbs, measured_tokens_per_s=measured)
