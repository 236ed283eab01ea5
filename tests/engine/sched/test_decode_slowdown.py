"""Decode latency under a long prefill (issue 14): while sequences decode, a step carries only the prompt tokens that
keep its cost within max_decode_slowdown times a decode-only step, the cost fitted to the step times the scheduler
measures. Step times here come from an injected clock that advances by a known cost per step: no wall-clock time."""

from __future__ import annotations

import pytest

from edgeserve.engine.config import EngineConfig
from edgeserve.engine.core import EngineCore
from edgeserve.engine.sched.prompt_pacing import FloorPacer
from edgeserve.engine.sched.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, Sequence
from edgeserve.engine.sched.step_cost import StepCostModel, StepKind, StepShape, chunk_shape
from edgeserve.models.load import load_model
from edgeserve.registry import resolve
from edgeserve.sampling_params import SamplingParams
from tiny_gguf import write_tiny_llama

SLOWDOWN = 1.5


class CostClock:
    """A clock that the test advances by the synthetic cost of each step: a + b * tokens + c * keys attended."""

    def __init__(self, a: float = 0.02, b: float = 0.002, c: float = 3e-6) -> None:
        self.now, self.a, self.b, self.c = 0.0, a, b, c

    def __call__(self) -> float:
        return self.now

    def cost(self, scheduled) -> float:
        shape = sum((chunk_shape(s.positions[0], s.num_new_tokens) for s in scheduled), StepShape(0, 0))
        return self.a + self.b * shape.tokens + self.c * shape.attended if scheduled else 0.0


def _scheduler(clock: CostClock, slowdown: float | None = SLOWDOWN) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, block_size=16,
                                     max_decode_slowdown=slowdown),
                     num_blocks=2048, enable_prefix_caching=False, clock=clock)


def _step(sched: Scheduler, clock: CostClock) -> SchedulerOutput:
    out = sched.schedule()
    clock.now += clock.cost(out.scheduled)
    sched.update(out, {s.seq_id: [7] for s in out.scheduled if s.samples})
    return out


def run_long_beside_decodes(clock: CostClock, slowdown: float | None = SLOWDOWN, decode_steps: int = 40):
    """Three short requests decode; a 4,000-token prompt arrives; after `decode_steps` the short ones end.
    Returns, per step: (the long prompt's tokens, the step's cost, the cost of its decode rows alone)."""
    sched = _scheduler(clock, slowdown)
    for i in range(3):
        sched.add(Sequence(f"s{i}", list(range(1 + i, 17 + i))))
    for _ in range(4):
        _step(sched, clock)
    sched.add(Sequence("long", list(range(1, 4001))))
    steps = []
    for n in range(decode_steps + 4):
        if n == decode_steps:
            for i in range(3):
                sched.finish(f"s{i}", "stop")
        out = _step(sched, clock)
        decodes = [s for s in out.scheduled if s.seq_id != "long"]
        long = sum(s.num_new_tokens for s in out.scheduled if s.seq_id == "long")
        steps.append((long, clock.cost(out.scheduled), clock.cost(decodes)))
    return steps


@pytest.mark.parametrize("attention_cost", [3e-6, 12e-6])
def test_prompt_tokens_beside_decodes_keep_the_step_within_the_slowdown(attention_cost):
    clock = CostClock(c=attention_cost)
    steps = run_long_beside_decodes(clock)
    mixed, alone = steps[:40], steps[40:]
    assert all(long >= 1 for long, *_ in steps)  # the long prompt moves every step
    # after the first few steps (the model's warm-up from one token, doubling), every step honours the bound
    for long, cost, decode_cost in mixed:
        assert long == 1 or cost <= SLOWDOWN * decode_cost * (1 + 1e-9)
    assert max(long for long, *_ in mixed) > 1  # the bound, not the floor, sets the chunk
    assert all(cost <= SLOWDOWN * decode_cost * (1 + 1e-9) for _, cost, decode_cost in mixed[8:])
    # no decodes: as large chunks as cost at most 1.5x a full budget at position 0 (issue 39), so more than beside
    # the decode rows, not the whole budget at this depth
    cap = SLOWDOWN * (clock.a + clock.b * 512 + clock.c * chunk_shape(0, 512).attended)
    assert all(cost <= cap * (1 + 1e-9) for _, cost, _ in alone)
    assert min(long for long, *_ in alone) > max(long for long, *_ in mixed[8:])


def test_the_budget_follows_the_measured_cost():
    cheap = run_long_beside_decodes(CostClock(b=5e-4, c=1e-6))
    costly = run_long_beside_decodes(CostClock(b=5e-4, c=12e-6))  # attention 12x dearer: a slower kernel
    assert sum(p for p, *_ in cheap[:40]) > 2 * sum(p for p, *_ in costly[:40])


def test_without_the_limit_every_step_carries_the_full_budget():
    clock = CostClock()
    steps = run_long_beside_decodes(clock, slowdown=None)
    assert all(long == 512 - 3 for long, *_ in steps[:7])  # beside 3 decode rows (the old behaviour)


def test_a_decode_step_alone_is_not_limited_and_idle_time_is_not_a_step():
    clock = CostClock()
    sched = _scheduler(clock)
    sched.add(Sequence("s0", list(range(1, 17))))
    for _ in range(5):
        _step(sched, clock)
    sched.finish("s0", "stop")
    clock.now += 1000.0  # the engine idles
    sched.add(Sequence("s1", list(range(1, 17))))
    for _ in range(5):
        _step(sched, clock)
    one_decode = chunk_shape(20, 1)
    expected = clock.a + clock.b * one_decode.tokens + clock.c * one_decode.attended
    assert sched.step_cost.predict(one_decode) == pytest.approx(expected, rel=1e-6)


def test_cost_model_fits_a_linear_cost_and_waits_for_enough_steps():
    model = StepCostModel()
    assert model.predict(StepShape(1, 1)) is None
    shapes = [StepShape(3, 150), StepShape(512, 131_328), StepShape(4, 1_200), StepShape(512, 600_000)]
    for kind, shape in zip([StepKind.DECODE, StepKind.PREFILL, StepKind.MIXED, StepKind.PREFILL], shapes):
        model.observe(kind, shape, 0.01 + 0.001 * shape.tokens + 2e-7 * shape.attended)
    assert model.predict(StepShape(10, 5_000)) == pytest.approx(0.01 + 0.01 + 0.001, rel=1e-6)


def run_shorts_beside_deep_prompt(clock: CostClock, slowdown: float | None = SLOWDOWN, depth: int = 2500,
                                  decode_steps: int = 48, late: int | None = None):
    """A 4,000-token prompt prefills alone to `depth` tokens; then three short requests arrive and decode for
    `decode_steps` steps beside it (a fourth arrives `late` steps in, when given). Returns, per decode step: (the
    long prompt's tokens, the step's cost, the cost of its decode rows alone, the late request's prompt tokens)."""
    sched = _scheduler(clock, slowdown)
    sched.add(Sequence("long", list(range(1, 4001))))
    while sched.get("long").num_computed_tokens < depth:
        _step(sched, clock)
    for i in range(3):
        sched.add(Sequence(f"s{i}", list(range(1 + i, 17 + i))))
    _step(sched, clock)  # their prompts (no decode rows yet: the full budget)
    steps = []
    for n in range(decode_steps):
        if n == late:
            sched.add(Sequence("late", list(range(5, 21))))
        out = _step(sched, clock)
        decodes = [s for s in out.scheduled if s.seq_id.startswith("s")]
        assert len(decodes) == 3
        tokens = {s.seq_id: s.num_new_tokens for s in out.scheduled}
        steps.append((tokens.get("long", 0), clock.cost(out.scheduled), clock.cost(decodes), tokens.get("late", 0)))
    return steps


def test_a_deep_prompt_whose_one_token_breaks_the_limit_is_paced_to_keep_the_mean_step_within_it():
    """Attention dear enough that one prompt token at depth 2,500+ costs 2.4x the decode rows' step: the old floor
    (a token every step) made every step 2.4x; now the deep prompt's token goes only on some steps, so the mean step
    stays within the limit, and the prompt still moves, at least once every FloorPacer.max_gap + 1 steps."""
    clock = CostClock(c=12e-6)
    steps = run_shorts_beside_deep_prompt(clock)
    long_steps = [i for i, (long, *_) in enumerate(steps) if long]
    costs, decode_costs = [c for _, c, _, _ in steps], [d for _, _, d, _ in steps]
    assert max(c / d for c, d in zip(costs, decode_costs)) > 2  # one owed token alone breaks 2x
    assert sum(costs) <= SLOWDOWN * sum(decode_costs) * 1.05
    assert all(long == 1 for long, *_ in steps if long)  # the floor, never more
    assert len(long_steps) >= len(steps) // (FloorPacer().max_gap + 1)
    gaps = [b - a for a, b in zip([-1] + long_steps, long_steps + [len(steps)])]
    assert max(gaps) <= FloorPacer().max_gap + 1
    # the bank pays for them: the pacer's steps are far fewer than every step
    assert 3 <= len(long_steps) <= len(steps) // 2


class DeepTokenClock(CostClock):
    """A cost clock with a cost no feature of the model captures: a step with a lone prompt token deeper than
    2,000 positions takes `extra` seconds more, so the fitted model predicts such steps too cheap."""

    extra = 0.03

    def cost(self, scheduled) -> float:
        deep = any(s.seq_id == "long" and s.num_new_tokens == 1 and s.positions[0] >= 2000 for s in scheduled)
        return super().cost(scheduled) + (self.extra if deep else 0.0)


def test_pacing_settles_measured_step_times_so_a_mispredicted_cost_still_keeps_the_mean():
    clock = DeepTokenClock(c=12e-6)
    steps = run_shorts_beside_deep_prompt(clock)
    long_steps = [i for i, (long, *_) in enumerate(steps) if long]
    costs, decode_costs = [c for _, c, _, _ in steps], [d for _, _, d, _ in steps]
    assert sum(costs) <= SLOWDOWN * sum(decode_costs) * 1.05
    assert len(long_steps) >= 6  # the bank pays for them, not only the max_gap rule


def test_a_deep_prompt_left_out_does_not_hold_back_a_new_short_prompt():
    clock = CostClock(c=12e-6)
    steps = run_shorts_beside_deep_prompt(clock, late=10)
    late = [(long, late) for long, _, _, late in steps[11:]]
    assert late[0][1] >= 1 and late[0][0] == 0  # its first tokens go at once, without the deep prompt's
    assert sum(n for _, n in late[:6]) >= 16  # its 16-token prompt done within 6 steps (then it decodes)


def test_a_deep_prompt_moves_every_max_gap_steps_even_without_slack():
    """With max_decode_slowdown 1.0 no step banks anything: the deep prompt still moves once every max_gap + 1."""
    clock = CostClock(c=12e-6)
    steps = run_shorts_beside_deep_prompt(clock, slowdown=1.0, decode_steps=40)
    long_steps = [i for i, (long, *_) in enumerate(steps) if long]
    assert len(long_steps) >= 2
    assert max(b - a for a, b in zip(long_steps, long_steps[1:])) == FloorPacer().max_gap + 1


def test_floor_pacer_pays_from_the_bank_or_after_max_gap():
    pacer = FloorPacer(max_gap=3)
    assert not pacer.pay(0.5)
    pacer.settle(0.2)
    assert not pacer.pay(0.5)
    pacer.settle(0.2)
    assert not pacer.pay(0.5) and pacer.waited == 3
    pacer.settle(0.2)
    assert pacer.pay(0.5) and pacer.waited == 0  # the bank covers it
    pacer.settle(-0.9)  # the step measured more over the limit than predicted: the bank goes below zero
    assert pacer.slack == pytest.approx(-0.3)
    for _ in range(3):
        assert not pacer.pay(0.1)
    assert pacer.pay(5.0) and pacer.waited == 0  # max_gap deferred steps: paid whatever it costs
    pacer.reset()
    assert (pacer.slack, pacer.waited) == (0.0, 0)


def test_cost_model_tells_key_reads_from_arithmetic():
    """A lone deep row reads all its keys for itself, where a chunk's rows share each read: with a cost that counts
    reads, the model fitted on decode, prompt and mixed steps predicts a deep prompt token beside decode rows
    exactly, where a model of tokens and attended keys alone is far off."""
    def cost(sh: StepShape) -> float:
        return 0.02 + 0.002 * sh.tokens + 1e-6 * sh.attended + 2e-5 * sh.read

    def decodes(ctx: int) -> StepShape:
        return chunk_shape(ctx, 1) + chunk_shape(ctx + 7, 1) + chunk_shape(ctx + 20, 1)

    model, no_reads = StepCostModel(), StepCostModel()
    steps = ([(StepKind.DECODE, decodes(c)) for c in (20, 60, 100, 140)]
             + [(StepKind.PREFILL, chunk_shape(s, 512)) for s in (0, 512, 1024, 1536)]
             + [(StepKind.MIXED, decodes(c) + chunk_shape(2048 + c, 64)) for c in (20, 60, 100)])
    for kind, shape in steps:
        model.observe(kind, shape, cost(shape))
        no_reads.observe(kind, StepShape(shape.tokens, shape.attended), cost(shape))
    deep = decodes(150) + chunk_shape(3000, 1)
    assert model.predict(deep) == pytest.approx(cost(deep), rel=1e-6)
    assert abs(no_reads.predict(StepShape(deep.tokens, deep.attended)) / cost(deep) - 1) > 0.2
    assert chunk_shape(100, 16).read == 108 + 116 and chunk_shape(0, 9).read == 8 + 9


def test_decode_slowdown_must_be_at_least_one():
    for bad in (0.5, 0, -1, float("nan"), "2", True):
        with pytest.raises(ValueError, match="max_decode_slowdown"):
            SchedulerConfig(max_decode_slowdown=bad)
        with pytest.raises(ValueError, match="max_decode_slowdown"):
            EngineConfig(max_decode_slowdown=bad)
    assert EngineConfig().max_decode_slowdown == 1.5
    assert SchedulerConfig().max_decode_slowdown is None


def _drive(core: EngineCore, clock: CostClock, long_prompt: list[int], shorts: list[list[int]]):
    """The long prompt, then the short ones after its first step; every output's token ids and each step's
    (prompt tokens, has decode rows)."""
    scheduler = core.scheduler
    schedule = scheduler.schedule
    last: list = []
    steps = []

    def timed_schedule():
        clock.now += clock.cost(last)
        out = schedule()
        last[:] = out.scheduled
        prompt = [s for s in out.scheduled if s.positions[0] < s.num_prompt_tokens]
        steps.append((sum(s.num_new_tokens for s in prompt), len(prompt) < len(out.scheduled)))
        return out

    scheduler.schedule = timed_schedule
    scheduler.clock = clock
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    core.add_request(long_prompt, params, "long")
    pending = [(f"s{i}", p) for i, p in enumerate(shorts)]
    while core.has_work():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        for rid, p in pending:
            core.add_request(p, params, rid)
        pending = []
    return tokens, steps


def test_engine_outputs_are_identical_with_and_without_the_limit(tmp_path):
    lm = load_model(resolve(str(write_tiny_llama(tmp_path / "t.gguf", hidden=64, heads=4, kv_heads=2, ffn=128))))
    long_prompt = [3 + (i * 37) % 250 for i in range(96)]
    shorts = [[3 + (i * 11 + j) % 250 for j in range(6)] for i in range(3)]
    results = {}
    for slowdown in (None, SLOWDOWN):
        core = EngineCore(lm, EngineConfig(kv_cache_gb=0.01, max_num_batched_tokens=48, max_num_seqs=4,
                                           enable_prefix_caching=False, max_decode_slowdown=slowdown))
        # attention dear enough that one step can afford only a few prompt tokens beside the decodes
        results[slowdown] = _drive(core, CostClock(a=0.02, b=0.002, c=1e-4), long_prompt, shorts)
    (plain, plain_steps), (limited, limited_steps) = results[None], results[SLOWDOWN]
    assert limited == plain and len(limited["long"]) == 24
    mixed = [p for p, has_decodes in limited_steps if has_decodes and p]
    assert mixed and max(mixed) < max(p for p, has_decodes in plain_steps if has_decodes and p)
    assert len(limited_steps) > len(plain_steps)  # the long prompt took more, cheaper steps
