"""edgeserve.bench.timing: warm-up calls are not timed, sides alternate A/B then B/A, medians and ratios come from
the clock's readings (a fake clock, so nothing depends on this machine's speed)."""

import pytest

from edgeserve.bench.timing import alternate, call_times, median_ms


class FakeClock:
    """Advances by the cost the running side set, each time a call ends."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def side(clock: FakeClock, cost: float, log: list, name: str):
    def fn():
        log.append(name)
        clock.now += cost
    return fn


def test_call_times_skips_warmup_and_reads_the_clock():
    clock, log = FakeClock(), []
    times = call_times(side(clock, 0.002, log, "a"), reps=3, warmup=2, clock=clock)
    assert log == ["a"] * 5
    assert times == pytest.approx([0.002] * 3)
    assert median_ms(side(clock, 0.004, log, "b"), reps=3, clock=clock) == pytest.approx(4.0)


def test_alternate_reverses_the_order_every_other_round_and_gives_ratios():
    clock, log = FakeClock(), []
    result = alternate({"a": side(clock, 0.001, log, "a"), "b": side(clock, 0.003, log, "b")}, rounds=3, warmup=1,
                       clock=clock)
    assert log == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert result.median_ms("a") == pytest.approx(1.0)
    assert result.min_ms("b") == pytest.approx(3.0)
    assert result.ratio("b", "a") == pytest.approx(3.0)


def test_bad_counts_are_refused():
    with pytest.raises(ValueError):
        call_times(lambda: None, reps=0)
    with pytest.raises(ValueError):
        alternate({}, rounds=2)
