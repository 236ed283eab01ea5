"""StateSlots: seats for running sequences and prefix-cache snapshots over one StatePool, and their budget."""

from __future__ import annotations

import pytest
import torch

from edgeserve.engine.cache.state_cache import StateBudget, StateSlots, state_budget
from edgeserve.engine.cache.state_pool import StateSpec
from edgeserve.kernels.torch.gated_delta import DeltaNetDims

SPEC = StateSpec(2, DeltaNetDims(1, 2, 4, 4, conv_kernel=3))


def slots(seats: int = 2, snapshots: int = 3) -> StateSlots:
    return StateSlots(SPEC, StateBudget(seats, snapshots, SPEC.bytes_per_sequence))


def test_budget_splits_seats_and_snapshots() -> None:
    per = SPEC.bytes_per_sequence
    b = state_budget(SPEC, 100 * per, max_num_seqs=8, prefix_caching=True)
    assert (b.seats, b.snapshots, b.nbytes) == (8, 8, 16 * per)
    b = state_budget(SPEC, 10 * per, max_num_seqs=8, prefix_caching=True)
    assert (b.seats, b.snapshots) == (5, 2)  # half the budget for seats, a quarter for snapshots
    assert state_budget(SPEC, 10 * per, 8, prefix_caching=False).snapshots == 0
    assert state_budget(SPEC, 1.5 * per, 8, True).seats == 1
    with pytest.raises(ValueError, match="holds no recurrent state"):
        state_budget(SPEC, per - 1, 8, True)


def test_seats_start_zeroed_and_come_back() -> None:
    s = slots()
    a = s.admit("a")
    s.pool.recurrent[a].fill_(3.0)
    s.release("a")
    b = s.admit("b")
    assert b == a and not s.pool.recurrent[b].any() and not s.pool.conv[b].any()
    s.admit("c")
    assert not s.can_admit()
    with pytest.raises(RuntimeError):
        s.admit("d")
    with pytest.raises(ValueError):
        s.admit("b")
    s.release("b"), s.release("c"), s.release("unknown")
    assert s.num_seated == 0
    s.check()


def test_snapshots_restore_and_keep_the_prompt_one_and_the_latest() -> None:
    s = slots()
    a = s.admit("a")
    s.pool.recurrent[a].fill_(1.0)
    s.snapshot("a", b"p", keep=True)
    s.pool.recurrent[a].fill_(2.0)
    s.snapshot("a", b"x", keep=False)
    s.pool.recurrent[a].fill_(3.0)
    s.snapshot("a", b"y", keep=False)  # "x" goes back: neither the prompt one nor the latest
    assert s.usable_prefix([b"p", b"x", b"y"]) == 3 and s.usable_prefix([b"p", b"x"]) == 1
    assert s.usable_prefix([b"q", b"x"]) == 0
    b = s.admit("b", b"p")
    assert torch.equal(s.pool.recurrent[b], torch.ones_like(s.pool.recurrent[b]))
    s.release("b")
    b = s.admit("b", b"y")
    assert bool((s.pool.recurrent[b] == 3.0).all())
    s.release("b")
    with pytest.raises(KeyError):
        s.admit("c", b"x")
    s.check()
    assert s.counters.snapshot_hits == 2


def test_snapshots_are_evicted_with_blocks_and_least_recently_used_first() -> None:
    s = slots(seats=1, snapshots=2)
    s.admit("a")
    s.snapshot("a", b"1", keep=True)
    s.snapshot("a", b"2", keep=False)
    s.snapshot("a", b"3", keep=False)  # "2" superseded, then room for "3"
    assert s.usable_prefix([b"1"]) == 1 and s.usable_prefix([b"1", b"2"]) == 1 and s.num_snapshots == 2
    s.release("a")
    s.admit("b")
    s.snapshot("b", b"4", keep=True)  # full: "1", the least recently used, goes
    assert s.usable_prefix([b"1"]) == 0 and s.usable_prefix([b"1", b"2", b"3"]) == 3
    s.evicted(b"3")
    assert s.num_snapshots == 1 and s.counters.snapshots_evicted == 1
    s.evicted(b"nothing")
    s.release("b")
    s.check()
    assert s.pool.num_used == 1


def test_backups_put_a_seat_back_and_go_with_it() -> None:
    s = StateSlots(SPEC, state_budget(SPEC, 100 * SPEC.bytes_per_sequence, 2, True, speculative=True))
    assert s.budget.backups == s.budget.seats == 2
    a = s.admit("a")
    s.pool.recurrent[a].fill_(1.0)
    s.backup("a")
    s.pool.recurrent[a].fill_(5.0)
    s.restore("a")
    assert bool((s.pool.recurrent[a] == 1.0).all())
    s.check()
    s.release("a")
    assert s.pool.num_used == 0
    with pytest.raises(RuntimeError, match="without speculative"):
        plain = slots()
        plain.admit("b")
        plain.backup("b")


def test_snapshot_points_are_before_each_turn_and_at_the_prompts_last_full_block() -> None:
    from edgeserve.engine.cache.snapshot_points import LADDER_TOKENS, MAX_PROMPT_POINTS, prompt_snapshot_points

    im = 1  # a turn-start token
    prompt = [im] + [5] * 20 + [im] + [6] * 30 + [im] + [7] * 3  # turns start at 0, 21 and 52; 56 tokens
    assert prompt_snapshot_points(prompt, len(prompt), 16, frozenset({im})) == (16, 48)
    assert prompt_snapshot_points(prompt, len(prompt), 16, frozenset()) == (48,)  # no markers: the last block only
    assert prompt_snapshot_points(prompt, 10, 16, frozenset({im})) == ()  # nothing before the first block ends
    many = ([im] + [5] * 15) * 20
    points = prompt_snapshot_points(many, len(many), 16, frozenset({im}))
    assert len(points) == MAX_PROMPT_POINTS and points[-1] == len(many) - 16  # the last ones
    long = [5] * (2 * LADDER_TOKENS + 100)  # one long message: a rung every LADDER_TOKENS, and the last block
    assert prompt_snapshot_points(long, len(long), 16, frozenset({im})) == (LADDER_TOKENS, 2 * LADDER_TOKENS,
                                                                             (len(long) - 1) // 16 * 16)


def test_room_is_made_by_letting_go_of_the_snapshot_that_saves_the_fewest_tokens() -> None:
    s = slots(seats=1, snapshots=3)
    s.admit("a")
    s.snapshot("a", b"deep", keep=True, num_blocks=9)
    s.snapshot("a", b"shallow", keep=True, num_blocks=1)
    s.snapshot("a", b"mid", keep=True, num_blocks=4)
    s.snapshot("a", b"new", keep=True, num_blocks=2)  # full: "shallow" goes, though "deep" is older
    assert s.usable_prefix([b"deep"]) == 1 and s.usable_prefix([b"shallow"]) == 0 and s.num_snapshots == 3
    s.snapshot("a", b"newer", keep=True, num_blocks=5)  # of deep, mid, new: new saves the fewest
    assert s.usable_prefix([b"new"]) == 0 and s.usable_prefix([b"mid"]) == 1
    s.release("a")
    s.check()
