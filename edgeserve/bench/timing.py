"""Timing of in-process benchmarks: a callable's per-call times after warm-up, and several sides timed in
alternation (A/B, B/A, ...) so that machine drift hits every side alike; medians and ratios."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

Clock = Callable[[], float]


def call_times(fn: Callable[[], object], reps: int, warmup: int = 1, clock: Clock = time.perf_counter) -> list[float]:
    """Seconds of each of `reps` calls of fn by `clock`, after `warmup` untimed calls."""
    if reps < 1:
        raise ValueError(f"reps must be at least 1, got {reps}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = clock()
        fn()
        times.append(clock() - start)
    return times


def median_ms(fn: Callable[[], object], reps: int, warmup: int = 1, clock: Clock = time.perf_counter) -> float:
    """Median milliseconds per call of fn over `reps` calls after `warmup`."""
    return statistics.median(call_times(fn, reps, warmup, clock)) * 1e3


@dataclass
class Alternation:
    """Per-call seconds of each side, in the order the sides were given."""

    times: dict[str, list[float]] = field(default_factory=dict)

    def median_ms(self, side: str) -> float:
        """The side's median milliseconds per call."""
        return statistics.median(self.times[side]) * 1e3

    def min_ms(self, side: str) -> float:
        """The side's fastest call in milliseconds (the steadier figure on a busy machine)."""
        return min(self.times[side]) * 1e3

    def ratio(self, side: str, base: str) -> float:
        """side's median time over base's (below 1.0: side is faster)."""
        return statistics.median(self.times[side]) / statistics.median(self.times[base])


def alternate(sides: dict[str, Callable[[], object]], rounds: int, warmup: int = 1, calls: int = 1,
              clock: Clock = time.perf_counter) -> Alternation:
    """Time every side `calls` times per round for `rounds` rounds, the order reversed every other round
    (A/B, B/A, ...), after `warmup` untimed calls of each side."""
    if rounds < 1 or not sides:
        raise ValueError("alternate needs at least one side and one round")
    for fn in sides.values():
        for _ in range(warmup):
            fn()
    result = Alternation({name: [] for name in sides})
    names = list(sides)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            result.times[name].extend(call_times(sides[name], calls, warmup=0, clock=clock))
    return result
