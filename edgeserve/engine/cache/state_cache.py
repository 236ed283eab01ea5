"""Recurrent-state slots of a hybrid model's sequences (Gated DeltaNet layers), beside the paged KV, and the state
snapshots that make prefix-cache hits usable for such a model.

Every running sequence holds one slot of the StatePool (a *seat*) from admission until it finishes, is cancelled or
is preempted (preemption recomputes, or swaps the seat's state out with the KV when offload tiers are on). The KV of
a cached prefix is not enough to resume a hybrid: the recurrent state at the prefix's end is needed too. So after a
step that leaves a sequence's computed tokens at a block boundary whose block is now cached (hashed), the sequence's
state is copied into a *snapshot* slot keyed by that block's hash. Kept per sequence: the snapshots at its prompt's
snapshot points (engine.cache.snapshot_points: before each chat turn, so a rewritten later turn still resumes after the
turns before it, a rung every few thousand tokens of a long prompt, and the prompt's last full block: the same
prompt again) and its latest one (a multi-turn chat's
next turn starts with this turn's tokens), older ones go back. A prefix hit is cut to the deepest hit block that has
a snapshot, whose state is then copied into the new sequence's seat; snapshots are evicted with their blocks, and
when the snapshot slots run out the one that saves the fewest tokens among the least recently used goes. Seats and
snapshots share one pool, sized from the KV budget at load.

With KV offload tiers (`offload`, edgeserve.offload.PoolOffload), a snapshot that leaves the device (its block
evicted, or let go of when the slots run out) goes down to the host and disk tiers under its block's
hash, beside that block, and `usable_prefix` brings one back up into a snapshot slot when a prefix hit reaches its
block in a tier (a missing or damaged copy is a miss: the hit stops at a shallower snapshot, or recomputes). At
shutdown every snapshot goes down (`offer_all`), so a conversation resumes after a restart from the disk tier. A
preempted sequence's seat is swapped out with its KV (the scheduler does that through the same bridge).

Speculative decoding: a step that verifies k drafts feeds all of them through the linear layers, so the state goes
past the tokens kept when some are rejected. Before such a step the seat's states are copied to the sequence's
backup slot; when a draft is rejected the backup is put back and the sequence's computed count goes back to before
the step, so the next step recomputes the accepted tokens (with the new one) from the right state.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, Protocol

import torch

from .state_pool import StatePool, StateSpec

log = logging.getLogger("edgeserve.engine")

SeqId = Hashable


@dataclass(frozen=True)
class StateBudget:
    """How many seats (running sequences), snapshot slots and speculation backups (one per seat with speculative
    decoding) a budget gives, and their bytes."""

    seats: int
    snapshots: int
    bytes_per_slot: int
    backups: int = 0

    @property
    def num_slots(self) -> int:
        return self.seats + self.snapshots + self.backups

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.bytes_per_slot


EVICT_WINDOW = 4  # snapshots evicted by value among this many least recently used
SEAT_FRACTION = 0.5  # at most this much of the KV budget for running sequences' states
SNAPSHOT_FRACTION = 0.25  # at most this much for prefix-cache snapshots


def state_budget(spec: StateSpec, budget_bytes: float, max_num_seqs: int, prefix_caching: bool,
                 speculative: bool = False) -> StateBudget:
    """Seats for up to `max_num_seqs` sequences within SEAT_FRACTION of the budget (at least one; with `speculative`
    each seat has a backup beside it, within the same fraction), and as many snapshot slots as seats (at least 2)
    within SNAPSHOT_FRACTION of it, when prefix caching is on. ValueError when not even one seat fits the budget."""
    per = spec.bytes_per_sequence
    need = 2 * per if speculative else per
    if need > budget_bytes:
        raise ValueError(f"the KV cache budget of {budget_bytes / 2**20:.1f} MiB holds no recurrent state of "
                         f"{need / 2**20:.2f} MiB (one sequence of this hybrid model)")
    seats = max(1, min(max_num_seqs, int(SEAT_FRACTION * budget_bytes // need)))
    snapshots = min(max(seats, 2), int(SNAPSHOT_FRACTION * budget_bytes // per)) if prefix_caching else 0
    if seats < max_num_seqs:
        log.info("the state budget holds %d of %d sequences' recurrent states (%.1f MiB each): at most %d run at "
                 "once", seats, max_num_seqs, per / 2**20, seats)
    return StateBudget(seats, snapshots, per, backups=seats if speculative else 0)


@dataclass
class _Seat:
    slot: int
    kept: set[bytes] = field(default_factory=set)  # its snapshots at its prompt's snapshot points (kept)
    latest_hash: bytes | None = None  # its latest snapshot
    backup: int | None = None  # its states before a speculative step (restored when drafts are rejected)


@dataclass
class StateCounters:
    """Snapshots taken, restored by prefix hits, evicted with their blocks, brought back from a tier; prompt tokens
    that a sequence did not compute because it resumed from a snapshot."""

    snapshots_taken: int = 0
    snapshot_hits: int = 0
    snapshots_evicted: int = 0
    snapshots_fetched: int = 0
    prompt_tokens_from_states: int = 0


class StateOffload(Protocol):
    """Tiers behind the snapshots (edgeserve.offload.PoolOffload over this pool)."""

    def offer_state(self, slot: int, block_hash: bytes) -> None:
        """Save the snapshot in `slot` (the state after block `block_hash`) before the slot is reused."""

    def contains_state(self, block_hash: bytes) -> bool:
        """Whether a tier claims the snapshot after block `block_hash`."""

    def fetch_state(self, block_hash: bytes, slot: int) -> bool:
        """Copy a tier's snapshot into `slot`; False when it is missing or corrupt."""


class StateSlots:
    """Seats and snapshots over one StatePool (`budget.seats + budget.snapshots` slots)."""

    def __init__(self, spec: StateSpec, budget: StateBudget, device: torch.device | str = "cpu") -> None:
        self.budget = budget
        self.pool = StatePool(spec, budget.num_slots, device)
        self._seats: dict[SeqId, _Seat] = {}
        self._snapshots: OrderedDict[bytes, int] = OrderedDict()  # block hash -> slot, least recently used first
        self.counters = StateCounters()
        self.offload: StateOffload | None = None  # where snapshots leaving the device go (KV offload tiers)
        self._depth: dict[bytes, int] = {}  # snapshot -> blocks it saves recomputing (its value)
        self.turn_markers: frozenset[int] = frozenset()  # token ids that start a chat turn (snapshot points)

    # --- seats -----------------------------------------------------------

    @property
    def num_seated(self) -> int:
        return len(self._seats)

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    def can_admit(self) -> bool:
        """Whether a new sequence can get a seat."""
        return len(self._seats) < self.budget.seats

    def admit(self, seq_id: SeqId, prefix_hash: bytes | None = None, num_tokens: int = 0) -> int:
        """Give `seq_id` a seat: zeroed states, or with `prefix_hash` (a prefix-cache hit of `num_tokens` tokens ending
        at that block) the snapshot's states. Returns its slot."""
        if seq_id in self._seats:
            raise ValueError(f"sequence {seq_id!r} already has a state slot")
        if not self.can_admit():
            raise RuntimeError(f"all {self.budget.seats} state seats are in use")
        src = None if prefix_hash is None else self._snapshots.get(prefix_hash)
        if prefix_hash is not None and src is None:
            raise KeyError("no state snapshot for the prefix hit")
        slot = self.pool.allocate(zero=src is None)
        self._seats[seq_id] = _Seat(slot)
        if src is not None:
            self.pool.copy(src, slot)
            self._snapshots.move_to_end(prefix_hash)
            self.counters.snapshot_hits += 1
            self.counters.prompt_tokens_from_states += num_tokens
        return slot

    def slot(self, seq_id: SeqId) -> int:
        """The slot of a seated sequence."""
        return self._seats[seq_id].slot

    def has_seat(self, seq_id: SeqId) -> bool:
        return seq_id in self._seats

    def release(self, seq_id: SeqId) -> None:
        """Give `seq_id`'s seat back (finished, cancelled, preempted); its snapshots stay. Unknown ids are ignored."""
        seat = self._seats.pop(seq_id, None)
        if seat is not None:
            self.pool.free(seat.slot)
            if seat.backup is not None:
                self.pool.free(seat.backup)

    # --- speculation rollback --------------------------------------------

    def backup(self, seq_id: SeqId) -> None:
        """Keep `seq_id`'s states before a step that verifies drafts (a step may feed tokens that get rejected)."""
        if not self.budget.backups:
            raise RuntimeError("no backup slots: the state budget was sized without speculative decoding")
        seat = self._seats[seq_id]
        if seat.backup is None:
            seat.backup = self.pool.allocate(zero=False)
        self.pool.copy(seat.slot, seat.backup)

    def restore(self, seq_id: SeqId) -> None:
        """Put back `seq_id`'s states from its last `backup` (its drafts were rejected: the state went too far)."""
        seat = self._seats[seq_id]
        if seat.backup is None:
            raise KeyError(f"sequence {seq_id!r} has no state backup")
        self.pool.copy(seat.backup, seat.slot)

    # --- snapshots -------------------------------------------------------

    def usable_prefix(self, hashes: list[bytes | None]) -> int:
        """How many leading blocks of a prefix hit (their hashes, in order) a hybrid can resume after: up to the
        deepest one with a snapshot on the device, or in a tier (then brought up into a snapshot slot here; a
        damaged or missing copy is passed over); 0: none."""
        for n in range(len(hashes), 0, -1):
            h = hashes[n - 1]
            if h in self._snapshots:
                return n
            if h is not None and self.offload is not None and self.offload.contains_state(h) and self._fetch(h, n):
                return n
        return 0

    def _fetch(self, block_hash: bytes, num_blocks: int) -> bool:
        """Bring a tier's snapshot after `block_hash` into a snapshot slot; False when it did not come back."""
        if not self.budget.snapshots:
            return False
        if len(self._snapshots) >= self.budget.snapshots:
            self._drop(self._victim(), offer=True)
        dst = self.pool.allocate(zero=False)
        if not self.offload.fetch_state(block_hash, dst):
            self.pool.free(dst)
            return False
        self._snapshots[block_hash] = dst
        self._depth[block_hash] = num_blocks
        self.counters.snapshots_fetched += 1
        return True

    def offer_all(self) -> int:
        """Hand every snapshot down to the tiers (at shutdown; they stay here too); return how many."""
        if self.offload is None:
            return 0
        for block_hash, slot in self._snapshots.items():
            self.offload.offer_state(slot, block_hash)
        return len(self._snapshots)

    def snapshot(self, seq_id: SeqId, block_hash: bytes, keep: bool, num_blocks: int = 0, ahead: int = 0) -> None:
        """Keep `seq_id`'s states now (its computed tokens end at the block `block_hash`, its `num_blocks`-th) as that
        block's snapshot; `keep`: this is one of its prompt's snapshot points (a turn boundary, its last full block:
        kept while the sequence lives, unless the slots run out). Its previous latest snapshot goes back unless it
        is a kept one. `ahead`: its computed tokens run that many past the block (a speculative step crossed it);
        the snapshot is then the states before the last `ahead` rows they still owe (StatePool.settle), and none
        is taken where they owe fewer."""
        seat = self._seats[seq_id]
        if not self.budget.snapshots or (ahead and not self.pool.settle(seat.slot, leave=ahead)):
            return
        old, seat.latest_hash = seat.latest_hash, block_hash
        if keep:
            seat.kept.add(block_hash)
        if old is not None and old != block_hash and not any(
                old in s.kept or old == s.latest_hash for s in self._seats.values()):
            self._drop(old)  # superseded first, so the one let go of below is another's
        self._depth[block_hash] = max(num_blocks, self._depth.get(block_hash, 0))
        if block_hash in self._snapshots:
            self._snapshots.move_to_end(block_hash)
            return
        if len(self._snapshots) >= self.budget.snapshots:
            self._drop(self._victim(), offer=True)
        dst = self.pool.allocate(zero=False)
        self.pool.copy(seat.slot, dst, settle=not ahead)
        self._snapshots[block_hash] = dst
        self.counters.snapshots_taken += 1

    def _victim(self) -> bytes:
        """The snapshot to let go of for room: of the EVICT_WINDOW least recently used, the one that saves the
        fewest tokens (every snapshot costs the same bytes: the fewest tokens saved per byte); the oldest of equals."""
        return min(itertools.islice(self._snapshots, EVICT_WINDOW), key=lambda h: self._depth.get(h, 0))

    def evicted(self, block_hash: bytes) -> None:
        """The block `block_hash` left the device's prefix cache: its snapshot (if any) goes too (down to the tiers,
        where the block went, when they are on)."""
        if block_hash in self._snapshots:
            self._drop(block_hash, offer=True)
            self.counters.snapshots_evicted += 1

    def _drop(self, block_hash: bytes, offer: bool = False) -> None:
        """Free a snapshot's slot; `offer`: hand it down to the tiers first (a superseded one is not worth it)."""
        slot = self._snapshots.pop(block_hash, None)
        self._depth.pop(block_hash, None)
        if slot is not None:
            if offer and self.offload is not None:
                self.offload.offer_state(slot, block_hash)
            self.pool.free(slot)

    # --- accounting ------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    def check(self) -> None:
        """AssertionError unless seats and snapshots account for exactly the pool's used slots."""
        self.pool.check()
        used = [s.slot for s in self._seats.values()] + list(self._snapshots.values()) + [
            s.backup for s in self._seats.values() if s.backup is not None]
        assert len(set(used)) == len(used) == self.pool.num_used, "state slots lost or shared"
        assert len(self._seats) <= self.budget.seats and len(self._snapshots) <= self.budget.snapshots
        assert set(self._depth) <= set(self._snapshots), "a value kept for a snapshot that is gone"
