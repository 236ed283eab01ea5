"""Benchmark statistics over request timings: TTFT, TPOT, inter-token latency, percentiles, tokens/s, goodput."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np

from edgeserve.bench.client import RequestResult

PERCENTILES = (50, 90, 99)


@dataclass
class Percentiles:
    """p50 / p90 / p99 and the mean of one quantity, in milliseconds (None when there were no samples)."""

    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    mean: float | None = None
    n: int = 0


@dataclass
class RequestTimes:
    """Per-request figures in seconds: arrays over the successful requests, in the same order."""

    ttft: np.ndarray
    e2e: np.ndarray
    tpot: np.ndarray  # NaN where a request produced fewer than 2 tokens
    output_tokens: np.ndarray
    prompt_tokens: np.ndarray
    itl: np.ndarray  # every inter-chunk gap of every request, flattened


@dataclass
class Summary:
    """One load level's results: latency percentiles (ms), rates, counts, and how tokens were counted."""

    completed: int
    errors: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    output_tokens: int
    prompt_tokens: int
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    itl_ms: Percentiles
    e2e_ms: Percentiles
    token_count_source: str  # "usage", "chunks" or "mixed"
    goodput_requests_per_s: float | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    error_messages: list[str] = field(default_factory=list)
    # speculative decoding over the requests whose usage reported it: accepted / proposed drafts, and tokens per
    # verification step (accepted drafts + the target's own token); None where no request drafted
    spec_acceptance_rate: float | None = None
    spec_tokens_per_step: float | None = None

    def to_dict(self) -> dict:
        """Plain JSON-ready dict."""
        return asdict(self)


def percentiles_ms(seconds: np.ndarray | Sequence[float]) -> Percentiles:
    """p50/p90/p99 and mean of `seconds` in ms, ignoring NaNs (linear interpolation, as numpy)."""
    a = np.asarray(seconds, dtype=np.float64)
    a = a[~np.isnan(a)]
    if a.size == 0:
        return Percentiles()
    p = np.percentile(a, PERCENTILES) * 1000.0
    return Percentiles(float(p[0]), float(p[1]), float(p[2]), float(a.mean() * 1000.0), int(a.size))


def tpot(e2e: np.ndarray, ttft: np.ndarray, output_tokens: np.ndarray) -> np.ndarray:
    """Time per output token after the first: (e2e - ttft) / (output_tokens - 1); NaN below 2 tokens."""
    e2e, ttft = np.asarray(e2e, np.float64), np.asarray(ttft, np.float64)
    n = np.asarray(output_tokens, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(n >= 2, (e2e - ttft) / (n - 1), np.nan)


def goodput(ttft: np.ndarray, tpot_s: np.ndarray, duration_s: float, slo_ttft_ms: float | None,
            slo_tpot_ms: float | None) -> float:
    """Requests per second that met both SLOs (an unset SLO always holds; a NaN TPOT meets any TPOT SLO)."""
    ok = np.ones(len(ttft), dtype=bool)
    if slo_ttft_ms is not None:
        ok &= np.asarray(ttft) * 1000.0 <= slo_ttft_ms
    if slo_tpot_ms is not None:
        t = np.asarray(tpot_s) * 1000.0
        ok &= np.isnan(t) | (t <= slo_tpot_ms)
    return float(ok.sum() / duration_s) if duration_s > 0 else 0.0


def request_times(results: Sequence[RequestResult]) -> RequestTimes:
    """Per-request TTFT, end-to-end, TPOT, token counts and the flattened inter-token gaps of the ok results."""
    ok = [r for r in results if r.ok and r.chunk_times]
    start = np.array([r.start for r in ok], np.float64)
    first = np.array([r.chunk_times[0] for r in ok], np.float64)
    end = np.array([r.end for r in ok], np.float64)
    out = np.array([r.output_tokens for r in ok], np.int64)
    prompt = np.array([r.prompt_tokens if r.prompt_tokens is not None else (r.expected_prompt_tokens or 0)
                       for r in ok], np.int64)
    gaps = [np.diff(np.asarray(r.chunk_times, np.float64)) for r in ok]
    itl = np.concatenate(gaps) if gaps else np.zeros(0)
    ttft = first - start
    e2e = end - start
    return RequestTimes(ttft, e2e, tpot(e2e, ttft, out), out, prompt, itl)


def summarize(results: Sequence[RequestResult], duration_s: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> Summary:
    """Summary of one load level: `duration_s` is the wall time the level ran (first send to last reply)."""
    t = request_times(results)
    failed = [r for r in results if not (r.ok and r.chunk_times)]
    sources = {r.token_source for r in results if r.ok and r.chunk_times}
    source = sources.pop() if len(sources) == 1 else ("mixed" if sources else "none")
    d = max(duration_s, 1e-9)
    n_out, n_prompt = int(t.output_tokens.sum()), int(t.prompt_tokens.sum())
    messages = sorted({r.error or "failed" for r in failed})[:5]
    use_slo = slo_ttft_ms is not None or slo_tpot_ms is not None
    return Summary(
        completed=len(t.ttft), errors=len(failed), duration_s=duration_s, requests_per_s=len(t.ttft) / d,
        output_tokens_per_s=n_out / d, total_tokens_per_s=(n_out + n_prompt) / d, output_tokens=n_out,
        prompt_tokens=n_prompt, ttft_ms=percentiles_ms(t.ttft), tpot_ms=percentiles_ms(t.tpot),
        itl_ms=percentiles_ms(t.itl), e2e_ms=percentiles_ms(t.e2e), token_count_source=source,
        goodput_requests_per_s=goodput(t.ttft, t.tpot, d, slo_ttft_ms, slo_tpot_ms) if use_slo else None,
        slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, error_messages=messages, **spec_rates(results))


def spec_rates(results: Sequence[RequestResult]) -> dict[str, float | None]:
    """Acceptance and tokens per verification step over the ok results whose usage reported drafts."""
    drafted = [r for r in results if r.ok and r.verifications]
    accepted = sum(r.accepted_drafts or 0 for r in drafted)
    proposed = accepted + sum(r.rejected_drafts or 0 for r in drafted)
    steps = sum(r.verifications for r in drafted)
    return {"spec_acceptance_rate": accepted / proposed if proposed else None,
            "spec_tokens_per_step": 1.0 + accepted / steps if steps else None}


def decode_tokens_per_s(results: Sequence[RequestResult]) -> float | None:
    """Median single-request decode rate, 1 / TPOT (tokens/s after the first token), over the ok requests."""
    t = request_times(results)
    v = t.tpot[~np.isnan(t.tpot)]
    return float(1.0 / np.median(v)) if v.size and np.median(v) > 0 else None
