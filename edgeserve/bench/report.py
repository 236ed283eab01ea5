"""The benchmark's end table (stdout) and its JSON document."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from edgeserve.bench.runner import LevelResult

if TYPE_CHECKING:  # only a type here; the roofline module loads torch
    from edgeserve.bench.roofline import Roofline


@dataclass
class BenchReport:
    """Everything one `edgeserve bench` run measured, and how."""

    url: str
    server_kind: str
    model: str | None
    workload: str
    prompt_format: str  # "token ids" (exact lengths) or "text" (about N tokens)
    workload_params: dict[str, Any]
    levels: list[LevelResult]
    roofline: Roofline | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: settings, one entry per load level (summary and per-request figures), roofline."""
        levels = []
        for lv in self.levels:
            levels.append({
                "concurrency": lv.level.concurrency, "request_rate": lv.level.rate, "cancelled": lv.cancelled,
                "summary": lv.summary.to_dict(),
                "requests": [{"ok": r.ok, "ttft_s": (r.chunk_times[0] - r.start) if r.chunk_times else None,
                              "e2e_s": r.end - r.start, "output_tokens": r.output_tokens,
                              "token_source": r.token_source, "chunks": r.chunks,
                              "prompt_tokens": r.prompt_tokens, "expected_prompt_tokens": r.expected_prompt_tokens,
                              "cached_tokens": r.cached_tokens, "accepted_drafts": r.accepted_drafts,
                              "rejected_drafts": r.rejected_drafts, "verifications": r.verifications,
                              "error": r.error} for r in lv.results],
            })
        return {"url": self.url, "server_kind": self.server_kind, "model": self.model, "workload": self.workload,
                "prompt_format": self.prompt_format, "workload_params": self.workload_params, "levels": levels,
                "roofline": self.roofline.to_dict() if self.roofline else None, "notes": self.notes}


def _f(v: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def format_table(report: BenchReport) -> str:
    """A plain-text table: one row per load level; latencies in ms as p50/p90/p99."""
    lines = [f"server {report.url} ({report.server_kind}), model {report.model or '?'}; workload "
             f"{report.workload} {report.workload_params}; prompts as {report.prompt_format}"]
    counts = {lv.summary.token_count_source for lv in report.levels}
    lines.append("output tokens counted from " + ", ".join(sorted(counts))
                 + " ('usage': the server's usage; 'chunks': SSE content chunks)")
    head = (f"{'load':<16} {'ok':>4} {'err':>4} {'req/s':>7} {'out tok/s':>10} {'tot tok/s':>10} "
            f"{'TTFT p50/p90/p99 ms':>22} {'TPOT p50/p90/p99 ms':>22} {'ITL p50/p99 ms':>16} "
            f"{'E2E p50/p99 ms':>16}")
    has_slo = any(lv.summary.goodput_requests_per_s is not None for lv in report.levels)
    if has_slo:
        head += f" {'goodput req/s':>13}"
    lines += [head, "-" * len(head)]
    for lv in report.levels:
        s = lv.summary
        row = (f"{lv.level.label:<16} {s.completed:>4} {s.errors:>4} {s.requests_per_s:>7.2f} "
               f"{s.output_tokens_per_s:>10.1f} {s.total_tokens_per_s:>10.1f} "
               f"{_f(s.ttft_ms.p50) + '/' + _f(s.ttft_ms.p90) + '/' + _f(s.ttft_ms.p99):>22} "
               f"{_f(s.tpot_ms.p50) + '/' + _f(s.tpot_ms.p90) + '/' + _f(s.tpot_ms.p99):>22} "
               f"{_f(s.itl_ms.p50) + '/' + _f(s.itl_ms.p99):>16} "
               f"{_f(s.e2e_ms.p50, '{:.0f}') + '/' + _f(s.e2e_ms.p99, '{:.0f}'):>16}")
        if has_slo:
            row += f" {_f(s.goodput_requests_per_s, '{:.2f}'):>13}"
        lines.append(row)
        if lv.cancelled:
            lines.append(f"  ({lv.cancelled} requests not finished within --duration)")
        if s.spec_acceptance_rate is not None:
            lines.append(f"  speculative decoding: {s.spec_acceptance_rate:.0%} of drafts accepted, "
                         f"{s.spec_tokens_per_step:.2f} tokens per verification step (the server's usage)")
        for msg in s.error_messages:
            lines.append(f"  error: {msg}")
    if has_slo:
        s0 = report.levels[0].summary
        lines.append(f"goodput: requests/s meeting TTFT <= {_f(s0.slo_ttft_ms, '{:g}')} ms and "
                     f"TPOT <= {_f(s0.slo_tpot_ms, '{:g}')} ms")
    if report.roofline:
        r = report.roofline
        lines.append(
            f"roofline: {r.weights_bytes / 1e6:.1f} MB weights + {r.kv_bytes_per_token} B/token KV x "
            f"{r.mean_context:.0f} tokens = {r.bytes_per_token / 1e6:.2f} MB read per decoded token; at "
            f"{r.bandwidth_gbs:.1f} GB/s ({r.bandwidth_source}) the bound is {r.max_tokens_per_s:.0f} tokens/s; "
            f"measured single stream {_f(r.measured_tokens_per_s)} tokens/s"
            + (f" ({100 * r.fraction:.0f}% of the bound)" if r.fraction else ""))
    return "\n".join(lines)


def write_json(report: BenchReport, dest: str) -> None:
    """Write the report's JSON to the file `dest` ('-': stdout)."""
    text = json.dumps(report.to_dict(), indent=2)
    if dest == "-":
        sys.stdout.write(text + "\n")
    else:
        with open(dest, "w") as f:
            f.write(text + "\n")
