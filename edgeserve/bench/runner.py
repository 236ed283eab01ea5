"""Run a workload against a server at one load level (closed loop or Poisson arrivals), and sweeps of levels."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import anyio
import httpx

from edgeserve.bench.client import RequestResult, stream_completion
from edgeserve.bench.stats import Summary, summarize
from edgeserve.bench.workloads import RequestSpec, poisson_arrivals


@dataclass
class LoadLevel:
    """How requests are sent: `concurrency` requests in flight at all times (closed loop), or Poisson
    arrivals at `rate` requests/s (open loop, at most `max_concurrency` in flight if set)."""

    concurrency: int | None = None
    rate: float | None = None

    @property
    def label(self) -> str:
        return f"concurrency {self.concurrency}" if self.concurrency is not None else f"rate {self.rate:g}/s"


@dataclass
class LevelResult:
    """The requests of one load level and their summary."""

    level: LoadLevel
    results: list[RequestResult]
    summary: Summary
    cancelled: int = 0  # requests not sent or cut off by --duration
    extra: dict[str, Any] = field(default_factory=dict)


class Progress:
    """A one-line progress bar on stderr (drawn only when stderr is a terminal, unless forced)."""

    def __init__(self, total: int, label: str, enabled: bool | None = None, width: int = 30) -> None:
        self.total, self.label, self.width = total, label, width
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.done = self.errors = 0
        self.t0 = time.perf_counter()

    def update(self, result: RequestResult) -> None:
        """Count one finished request and redraw."""
        self.done += 1
        self.errors += 0 if result.ok else 1
        if self.enabled:
            filled = int(self.width * self.done / max(self.total, 1))
            bar = "#" * filled + "-" * (self.width - filled)
            sys.stderr.write(f"\r{self.label:<18} [{bar}] {self.done}/{self.total} "
                             f"errors {self.errors} {time.perf_counter() - self.t0:6.1f}s")
            sys.stderr.flush()

    def close(self) -> None:
        """End the bar's line."""
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


async def run_level(url: str, specs: Sequence[RequestSpec], level: LoadLevel, model: str | None = None,
                    extra_body: dict[str, Any] | None = None, duration: float | None = None, seed: int = 0,
                    slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
                    progress: bool | None = None, on_result: Callable[[RequestResult], None] | None = None,
                    ) -> LevelResult:
    """Send `specs` to `url` at `level`; stop sending (and cut off what is in flight) after `duration`
    seconds. Returns every finished request and their summary (duration = first send to last finish)."""
    results: list[RequestResult] = []
    bar = Progress(len(specs), level.label, progress)
    n_conc = level.concurrency or len(specs)
    limits = httpx.Limits(max_connections=max(n_conc, 1) + 4, max_keepalive_connections=max(n_conc, 1) + 4)
    sent = 0
    t0 = time.perf_counter()

    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0, connect=10.0)) as client:

        async def one(spec: RequestSpec) -> None:
            r = await stream_completion(client, url, spec, model, extra_body)
            results.append(r)
            bar.update(r)
            if on_result is not None:
                on_result(r)

        with anyio.move_on_after(duration if duration else float("inf")):
            async with anyio.create_task_group() as tg:
                if level.concurrency is not None:
                    queue = list(reversed(specs))

                    async def worker() -> None:
                        nonlocal sent
                        while queue:
                            spec = queue.pop()
                            sent += 1
                            await one(spec)

                    for _ in range(min(level.concurrency, len(specs))):
                        tg.start_soon(worker)
                else:
                    assert level.rate is not None
                    for spec, at in zip(specs, poisson_arrivals(len(specs), level.rate, seed).tolist()):
                        delay = t0 + at - time.perf_counter()
                        if delay > 0:
                            await anyio.sleep(delay)
                        sent += 1
                        tg.start_soon(one, spec)
    bar.close()
    elapsed = (max(r.end for r in results) - t0) if results else time.perf_counter() - t0
    summary = summarize(results, elapsed, slo_ttft_ms, slo_tpot_ms)
    return LevelResult(level, results, summary, cancelled=len(specs) - len(results))


def run_level_sync(*args, **kwargs) -> LevelResult:
    """run_level from synchronous code (its own event loop)."""
    return anyio.run(lambda: run_level(*args, **kwargs))
