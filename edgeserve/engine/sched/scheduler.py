"""Continuous batching: which sequences run each step, and how many tokens each (chunked prefill, preemption).

Every sequence has `num_computed_tokens` catching up with `num_tokens` (prompt + outputs): a prefill chunk,
a decode step and a prefix-cache hit are all just that count moving forward.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

from edgeserve.errors import QueueFullError

from ..cache.kv_blocks import BlockManager, BlockOffload
from .prompt_pacing import FloorPacer
from ..cache.snapshot_points import prompt_snapshot_points
from .step_cost import StepCostModel, StepKind, StepShape, chunk_shape
from .request_state import Registry, SeqId, SeqStatus, Sequence  # noqa: F401  (Sequence, SeqStatus: re-exported)

if TYPE_CHECKING:  # the state cache imports torch, which `edgeserve --help` must not
    from ..cache.state_cache import StateSlots


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_waiting: int = 256
    block_size: int = 16
    # True: the step's prompt-token budget is split fairly between everything prefilling (a new request's prefill
    # starts at once, however long the prompts before it); False: first come, first served (the long one first)
    fair_prefill: bool = True
    # A step with decode rows carries only the prompt tokens that keep its measured cost within this factor of a
    # decode-only step (a prefilling sequence still gets a token every step, or where even that one token breaks
    # the limit, on enough steps to keep the mean step within it: prompt_pacing); None: the whole token budget
    max_decode_slowdown: float | None = None
    # With max_decode_slowdown set, steps without decode rows are bounded by cost too: a step that gives a new
    # request its first token (its whole prompt) carries only the other prompts' tokens that keep it within
    # max_decode_slowdown times that request's own prefill, and any other prefill step costs at most that factor
    # times a full token budget at the start of a context (a deep prompt's chunks shrink as their attention
    # grows), so a short request arriving beside a deep prefill waits one bounded step, then gets its first token
    # at near its unloaded TTFT. False: prefill-only steps fill the token budget whatever it costs.
    bound_prefill_steps: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        check_decode_slowdown(self.max_decode_slowdown)


def check_decode_slowdown(value: float | None) -> None:
    """ValueError unless `value` is None or a number of at least 1 (a factor on a decode-only step's time)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1.0):
        raise ValueError(f"max_decode_slowdown must be a number of at least 1.0 or None, got {value!r}")


@dataclass
class ScheduledSeq:
    """What the model runner needs for one sequence this step (plain lists; the runner tensorizes)."""

    seq_id: SeqId
    token_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    block_table: list[int]  # the block manager's live list (no copy): read it during this step only
    context_len: int  # tokens with KV once this step is done
    samples: bool  # this step reaches the last token, so a token is sampled
    num_spec: int = 0  # trailing speculative tokens in token_ids (verified this step, maybe rolled back)
    num_prompt_tokens: int = 0  # the request's prompt length: positions below it are prompt tokens
    state_slot: int = -1  # a hybrid model's recurrent-state slot of the sequence (engine.cache.state_cache); -1: none
    images: tuple = ()  # the request's image rows (request_state.ImageRows) while its prompt is computed
    mrope: Any = None  # the request's M-RoPE positions (models.mrope.MRopePositions), None for 1-D positions
    attend_spans: tuple = ()  # the request's bidirectional prompt spans (request_state.AttendSpan) while its prompt
    # is computed

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    """One step: the sequences to run, in batch order, those preempted to make room, and those retired."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[SeqId] = field(default_factory=list)
    finished: list[SeqId] = field(default_factory=list)  # outgrew the whole KV pool (reason "length")

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def token_ids(self) -> list[int]:
        return [t for s in self.scheduled for t in s.token_ids]

    @property
    def positions(self) -> list[int]:
        return [p for s in self.scheduled for p in s.positions]

    @property
    def slot_mapping(self) -> list[int]:
        return [x for s in self.scheduled for x in s.slot_mapping]

    @property
    def block_tables(self) -> list[list[int]]:
        return [s.block_table for s in self.scheduled]

    @property
    def context_lens(self) -> list[int]:
        return [s.context_len for s in self.scheduled]


class SwapOffload(BlockOffload, Protocol):
    """Tiers that also hold preempted sequences' KV (edgeserve.offload.PoolOffload)."""

    def swap_out(self, seq_id: SeqId, block_ids: list[int], state_slot: int | None = None) -> bool:
        """Copy the blocks (and a hybrid's state slot) to swap space; False if there is no room."""

    def swap_in(self, seq_id: SeqId, block_ids: list[int], state_slot: int | None = None) -> bool:
        """Copy the swapped blocks back into `block_ids` (and the state into `state_slot`); False if they are
        gone."""

    def drop_swap(self, seq_id: SeqId) -> None:
        """Forget a swapped sequence."""


class Scheduler:
    """FCFS continuous batching under a token budget and a sequence cap, over one BlockManager (and, for a hybrid
    model, its recurrent-state seats and snapshots)."""

    def __init__(self, config: SchedulerConfig, num_blocks: int, enable_prefix_caching: bool = True,
                 offload: SwapOffload | None = None, registry: Registry | None = None,
                 clock: Callable[[], float] = time.perf_counter, states: StateSlots | None = None) -> None:
        """`registry`: the request states shared with the engine core, which forgets the finished ones itself;
        without it the scheduler keeps its own and forgets a sequence when it finishes it. `clock`: seconds, read
        once per `schedule()` to time the steps (for `max_decode_slowdown`). `states`: a hybrid model's
        recurrent-state slots: a sequence holds a seat while it runs, prefix hits stop at a state snapshot, and
        a prompt's chunks stop at its snapshot points so its state there is snapshotted (engine.cache.state_cache)."""
        self.config = config
        self._owns_registry = registry is None
        self._seqs: Registry = Registry() if registry is None else registry
        self.block_manager = BlockManager(num_blocks, config.block_size, enable_prefix_caching, offload=offload,
                                          registry=self._seqs)
        self.offload = offload  # swap-based preemption when set (recompute stays the fallback)
        self.states = states
        # set per step by the engine: a hybrid's rejected drafts never reached its states (the runner replayed the
        # accepted ones), so no restore
        self.replays_drafts = False
        if states is not None:
            if enable_prefix_caching:
                self.block_manager.usable_prefix = states.usable_prefix
                self.block_manager.on_evict = states.evicted
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest arrival first
        self._arrivals = 0
        self.num_preemptions = 0
        self.clock = clock
        self.step_cost = StepCostModel()  # fitted to the step times measured between schedule() calls
        self._timing: tuple[StepKind, StepShape, float] | None = None  # the step in progress, since when
        self._mixed_prompt_tokens = 0  # prompt tokens of the last step, if it had decode rows
        self.pacer = FloorPacer()  # when the owed prompt tokens alone break max_decode_slowdown
        self._paced_limit: float | None = None  # the limit of the step in progress, if the pacer decided it

    # --- requests ----------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new request; QueueFullError ('busy') when the waiting queue is full."""
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError()
        if seq.seq_id in self._seqs:
            raise ValueError(f"duplicate sequence id {seq.seq_id!r}")
        if not seq.num_prompt_tokens:
            raise ValueError("empty prompt")
        if self.block_manager.blocks_needed(seq.num_tokens) > self.block_manager.num_blocks:
            raise ValueError(f"prompt of {seq.num_tokens} tokens does not fit in the KV cache")
        if not self._seqs:
            self._timing = None  # the engine idled since the last step: that gap is no step's cost
        if self._snapshots_on:
            seq.snapshot_points = prompt_snapshot_points(seq.all_token_ids, seq.num_prompt_tokens,
                                                         self.config.block_size, self.states.turn_markers)
        seq.arrival, self._arrivals = self._arrivals, self._arrivals + 1
        seq.status, seq.num_computed_tokens = SeqStatus.WAITING, 0
        self._seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def get(self, seq_id: SeqId) -> Sequence:
        return self._seqs[seq_id]

    def has(self, seq_id: SeqId) -> bool:
        """Whether `seq_id` is waiting or running."""
        seq = self._seqs.get(seq_id)
        return seq is not None and seq.status is not SeqStatus.FINISHED

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def finish(self, seq_id: SeqId, reason: str) -> Sequence:
        """Retire a sequence and free its blocks now (it stays in a shared registry until its owner forgets it)."""
        seq = self._seqs[seq_id]
        if seq.status is SeqStatus.FINISHED:
            raise KeyError(seq_id)
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        if self.block_manager.has_seq(seq_id):
            self.block_manager.free(seq_id)
        if self.states is not None:
            self.states.release(seq_id)
        if seq.swapped:
            self.offload.drop_swap(seq_id)
            seq.swapped = False
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        if self._owns_registry:
            del self._seqs[seq_id]
        return seq

    def abort(self, seq_id: SeqId) -> Sequence:
        return self.finish(seq_id, "abort")

    # --- one step ----------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work: running decodes, then prefill chunks of running and newly admitted requests
        (fewer prompt tokens beside decodes under `max_decode_slowdown`); times the previous step."""
        limited = self.config.max_decode_slowdown is not None
        now = self.clock() if limited else 0.0
        if limited and self._timing is not None:
            kind, shape, start = self._timing
            self.step_cost.observe(kind, shape, now - start)
            if self._paced_limit is not None:
                self.pacer.settle(self._paced_limit - (now - start))
        self._paced_limit = None
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_decodes(out, budget)
        decodes = _shape(out.scheduled) if limited else StepShape(0, 0)
        decoding = {s.seq_id for s in out.scheduled}
        prefilling = [seq for seq in self.running if seq.num_remaining > 1 and seq.seq_id not in decoding]
        if self.config.fair_prefill:
            room = budget - len(prefilling)  # every prefill gets at least one token
        else:
            room = budget - sum(seq.num_remaining for seq in prefilling)
        prefilling += self._admit_waiting(room)
        if decodes.tokens and prefilling:
            budget, prefilling = self._prompt_budget(decodes, prefilling, budget)
        elif limited and self.config.bound_prefill_steps and prefilling:
            budget, prefilling = self._bounded_prefill(out, prefilling, budget)
        shares = split_budget([seq.num_remaining for seq in prefilling], budget, self.config.fair_prefill)
        for seq, n in zip(prefilling, shares):
            if n:
                out.scheduled.append(self._build(seq, n))
        if limited:
            prompt = out.num_batched_tokens - decodes.tokens
            self._mixed_prompt_tokens = prompt if decodes.tokens else 0
            kind = StepKind.PREFILL if not decodes.tokens else StepKind.MIXED if prompt else StepKind.DECODE
            self._timing = (kind, _shape(out.scheduled), now) if out.scheduled else None
        return out

    def update(self, output: SchedulerOutput, sampled: dict[SeqId, list[int]]) -> None:
        """Account for a finished step: advance computed counts, cache full blocks, append sampled tokens."""
        for s in output.scheduled:
            seq = self._seqs.get(s.seq_id)
            if seq is None or seq.status is not SeqStatus.RUNNING:
                continue  # finished or aborted while the step ran
            if (s.num_spec and self.states is not None and not self.replays_drafts
                    and len(sampled[seq.seq_id]) <= s.num_spec):
                # a hybrid whose drafts were not all accepted: its state fed them all, so it goes back to before
                # the step and the accepted tokens are computed again (with the new one) from there
                self.states.restore(seq.seq_id)
                seq.num_computed_tokens = s.positions[0]
                # slots stay reserved for every token it holds once the new ones are in (they are computed next)
                self.block_manager.truncate(seq.seq_id, seq.num_tokens + len(sampled[seq.seq_id]))
            elif s.num_spec:
                # KV stays only for the drafts that were accepted: every emitted token but the last one
                seq.num_computed_tokens += s.num_new_tokens - s.num_spec + len(sampled[seq.seq_id]) - 1
                self.block_manager.truncate(seq.seq_id, seq.num_computed_tokens)
            else:
                seq.num_computed_tokens += s.num_new_tokens
            seq.spec_token_ids = []
            if s.samples:  # first: a verification's accepted drafts are computed tokens whose blocks are hashed
                seq.append_output(sampled[seq.seq_id])
            self.block_manager.commit_full_blocks(seq.seq_id, seq.all_token_ids, seq.num_computed_tokens)
            if self.states is not None:
                self._snapshot(seq, s.positions[0])

    # --- phases ------------------------------------------------------------

    def _schedule_decodes(self, out: SchedulerOutput, budget: int) -> int:
        """One token per running sequence that is past its prompt, preempting the newest when blocks run out (a
        hybrid's accepted tokens to compute again after a partly rejected step go with its new drafts)."""
        for seq in list(self.running):
            if budget == 0:
                break
            n = seq.num_remaining
            if seq.status is not SeqStatus.RUNNING or not (n == 1 or _redecodes(seq)) or n > budget:
                continue  # preempted earlier in this loop, or still prefilling
            if not self._reserve_or_preempt(seq, out):
                continue  # seq itself was preempted or retired
            spec = seq.spec_token_ids[: budget - n]
            # speculative tokens take only free blocks, and leave one per running sequence for plain decodes
            bm = self.block_manager
            if spec and (bm.num_free_blocks < len(self.running)
                         or not bm.ensure_capacity(seq.seq_id, seq.num_tokens + len(spec))):
                spec = []
            out.scheduled.append(self._build(seq, n, spec))
            budget -= n + len(spec)
        return budget

    def _prompt_budget(self, decodes: StepShape, prefilling: list[Sequence],
                       budget: int) -> tuple[int, list[Sequence]]:
        """Prompt tokens for a step that has decode rows, and the prefilling sequences they go to: the most (up to
        `budget`) whose split keeps the step's predicted cost within max_decode_slowdown times the decode rows'
        alone, at most twice the last such step's (a cost model fitted on other shapes is not trusted far from
        what it has seen), and never fewer than one token for each prefill the split serves. A prefill whose one
        token alone would break the limit (a deep one) is left out of some steps, as `FloorPacer` decides."""
        fair = self.config.fair_prefill
        base = self.step_cost.predict(decodes)
        if base is None:
            return min(budget, len(prefilling) if fair else 1), prefilling
        limit = self.config.max_decode_slowdown * base

        def cost(seqs: list[Sequence], b: int) -> float:
            shape = decodes
            for seq, n in zip(seqs, split_budget([seq.num_remaining for seq in seqs], b, fair)):
                shape = shape + chunk_shape(seq.num_computed_tokens, n)
            return self.step_cost.predict(shape)

        def floor(seqs: list[Sequence]) -> int:
            return min(budget, len(seqs) if fair else 1)

        served, owed = prefilling, cost(prefilling, floor(prefilling))
        if owed > limit:
            self._paced_limit = limit
            if not self.pacer.pay(owed - limit):
                served = list(prefilling)  # the deepest out until the rest's owed tokens fit
                while served and cost(served, floor(served)) > limit:
                    served.remove(max(served, key=lambda seq: seq.num_computed_tokens))
        else:
            self.pacer.reset()
        if not served:
            return 0, []
        lo, cap = floor(served), min(budget, 2 * self._mixed_prompt_tokens)
        hi = max(lo, cap)  # cost(served, lo) <= limit is assumed (the floor is owed); find the largest that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if cost(served, mid) <= limit:
                lo = mid
            else:
                hi = mid - 1
        return lo, served

    def _bounded_prefill(self, out: SchedulerOutput, prefilling: list[Sequence],
                         budget: int) -> tuple[int, list[Sequence]]:
        """A step of prompt tokens only (`bound_prefill_steps`): the prefills whose whole rest fits their share
        (their first token comes from this step) are scheduled here and protected like decode rows, the others
        get what `_prompt_budget` allows beside them; with no first token at stake, the step's predicted cost is
        held to max_decode_slowdown times that of a full budget from position 0. Returns the others' budget and who
        gets it."""
        fair = self.config.fair_prefill
        shares = split_budget([seq.num_remaining for seq in prefilling], budget, fair)
        first = [seq for seq, n in zip(prefilling, shares) if n == seq.num_remaining]
        rest = [seq for seq in prefilling if seq not in first]
        if first and rest:
            for seq in first:
                out.scheduled.append(self._build(seq, seq.num_remaining))
            budget -= sum(seq.num_remaining for seq in first)
            return self._prompt_budget(_shape(out.scheduled), rest, budget)
        full = self.step_cost.predict(chunk_shape(0, self.config.max_num_batched_tokens))
        if full is None:
            return budget, prefilling
        cap = self.config.max_decode_slowdown * full
        self.pacer.reset()

        def cost(b: int) -> float:
            shape = StepShape(0, 0)
            for seq, n in zip(prefilling, split_budget([seq.num_remaining for seq in prefilling], b, fair)):
                shape = shape + chunk_shape(seq.num_computed_tokens, n)
            return self.step_cost.predict(shape)

        lo, hi = min(budget, len(prefilling) if fair else 1), budget  # the floor moves every prompt
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if cost(mid) <= cap:
                lo = mid
            else:
                hi = mid - 1
        return lo, prefilling

    def _admit_waiting(self, room: int) -> list[Sequence]:
        """Move waiting sequences to running in FCFS order while seats, blocks and `room` (prompt tokens for
        them this step) allow; returns them in admission order."""
        bm = self.block_manager
        admitted = []
        while self.waiting and room > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not bm.can_allocate(seq.num_tokens) or (self.states is not None and not self.states.can_admit()):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            if not (seq.swapped and self._swap_in(seq)):
                self._allocate(seq)
            seq.status = SeqStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.arrival)
            admitted.append(seq)
            room -= 1 if self.config.fair_prefill else seq.num_remaining
        return admitted

    def _reserve_or_preempt(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Make room for `seq`'s next token, preempting the newest running sequences; False if `seq` lost its seat."""
        while not self.block_manager.ensure_capacity(seq.seq_id, seq.num_tokens):
            if len(self.running) == 1:
                # Alone and still out of blocks: it can never grow, and requeueing it would hang.
                self.finish(seq.seq_id, "length")
                out.finished.append(seq.seq_id)
                return False
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _allocate(self, seq: Sequence) -> None:
        """Give an admitted sequence its blocks (prefix hits included) and, for a hybrid, its seat."""
        bm = self.block_manager
        seq.num_computed_tokens = bm.allocate(seq.seq_id, seq.all_token_ids, seq.prefix_key)
        if self.states is not None:  # a hit resumes from the snapshot at its end
            n = seq.num_computed_tokens
            self.states.admit(seq.seq_id, bm.prefix_hash(seq.seq_id, n // bm.block_size), num_tokens=n)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Swap `seq`'s KV (and a hybrid's state) out to the host tier, or drop it (recomputed later, partly from the
        prefix cache); requeue it first."""
        self.running.remove(seq)
        seq.spec_token_ids = []  # drafts are never computed KV: nothing of them to keep
        bm = self.block_manager
        computed_blocks = bm.block_table(seq.seq_id)[:bm.blocks_needed(seq.num_computed_tokens)]
        state_slot = self.states.slot(seq.seq_id) if self.states is not None else None
        seq.swapped = bool(self.offload is not None and computed_blocks
                           and self.offload.swap_out(seq.seq_id, computed_blocks, state_slot=state_slot))
        bm.free(seq.seq_id)
        if self.states is not None:  # recomputed from its tokens (and maybe a snapshot) when it comes back
            self.states.release(seq.seq_id)
        if not seq.swapped:
            seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq.seq_id)
        self.num_preemptions += 1

    def _swap_in(self, seq: Sequence) -> bool:
        """Give a swapped-out sequence fresh blocks (and a hybrid a seat) and its KV (and state) back; False (nothing
        held) when the swap copy is gone: then it is allocated like a new one."""
        bm = self.block_manager
        seq.swapped = False
        table = bm.allocate_uncached(seq.seq_id, seq.num_tokens, seq.prefix_key)
        slot = self.states.admit(seq.seq_id) if self.states is not None else None
        if self.offload.swap_in(seq.seq_id, table[:bm.blocks_needed(seq.num_computed_tokens)], state_slot=slot):
            bm.commit_full_blocks(seq.seq_id, seq.all_token_ids, seq.num_computed_tokens)
            return True
        bm.free(seq.seq_id)
        if self.states is not None:
            self.states.release(seq.seq_id)
        return False

    @property
    def _snapshots_on(self) -> bool:
        """Whether a hybrid's states are snapshotted for the prefix cache."""
        return self.states is not None and bool(self.states.budget.snapshots) and \
            self.block_manager.enable_prefix_caching

    def _snapshot(self, seq: Sequence, start: int) -> None:
        """After a step that began at computed token `start`: keep a hybrid sequence's state as the snapshot of the
        block its computed tokens now end at (kept while it lives at its prompt's snapshot points, else until its
        next one), or of the last block the step crossed when its state still owes the rows past it (a verification
        step's accepted drafts, StatePool.owed)."""
        bm = self.block_manager
        n = seq.num_computed_tokens
        block = n // bm.block_size
        end = block * bm.block_size
        if end <= start or not self.states.budget.snapshots:
            return
        h = bm.prefix_hash(seq.seq_id, block)
        if h is not None:
            self.states.snapshot(seq.seq_id, h, keep=end in seq.snapshot_points, num_blocks=block, ahead=n - end)

    def _build(self, seq: Sequence, n: int, spec: list[int] | None = None) -> ScheduledSeq:
        start = seq.num_computed_tokens
        for point in seq.snapshot_points:  # a hybrid's chunk stops at the next one, so the state there can be kept
            if start < point < start + n:
                n = point - start
                break
        stop = span_stop(start, start + n, seq.attend_spans)
        end = stop + len(spec or ())
        return ScheduledSeq(
            seq_id=seq.seq_id,
            token_ids=seq.all_token_ids[start:stop] + list(spec or ()),
            positions=list(range(start, end)),
            slot_mapping=self.block_manager.slots(seq.seq_id, start, end),
            block_table=self.block_manager.block_ids(seq.seq_id),
            context_len=end,
            samples=stop == seq.num_tokens,
            num_spec=len(spec or ()),
            num_prompt_tokens=seq.num_prompt_tokens,
            state_slot=self.states.slot(seq.seq_id) if self.states is not None else -1,
            images=seq.images if start < seq.num_prompt_tokens else (),
            mrope=seq.mrope,
            attend_spans=seq.attend_spans if start < seq.num_prompt_tokens else (),
        )


def _redecodes(seq: Sequence) -> bool:
    """Whether `seq` is past its prompt with more than its last token to compute (a hybrid's accepted drafts after a
    partly rejected step: its state went back to before them) and has new drafts: then those tokens are computed
    again in the same step that verifies the new drafts, as one decode row."""
    return seq.num_remaining > 1 and seq.num_computed_tokens >= seq.num_prompt_tokens and bool(seq.spec_token_ids)


def span_stop(start: int, stop: int, spans: tuple) -> int:
    """Where a chunk from `start` that would stop at `stop` stops so that no bidirectional span is cut: before a
    span it would end inside, or, when the chunk starts inside or at that span, past its end (beyond the budget:
    a span's tokens need all of its keys in the pool when they attend)."""
    for a, b in spans:
        if a < stop < b:
            return b if a <= start else a
    return stop


def _shape(scheduled: list[ScheduledSeq]) -> StepShape:
    """The cost features of these scheduled sequences together."""
    return sum((chunk_shape(s.positions[0], s.num_new_tokens) for s in scheduled), StepShape(0, 0))


def split_budget(remaining: list[int], budget: int, fair: bool = True) -> list[int]:
    """Tokens each prefill computes this step, out of `budget`, given the tokens each has left (in arrival order).

    fair: max-min fair shares: shortest first, each takes at most an equal share of what is left, so a short
    prompt finishes in one step beside a long one and the long one still gets at least budget / count; tokens a
    floor division leaves over go to the earliest. Otherwise first come, first served.
    """
    shares = [0] * len(remaining)
    left = budget
    if fair:
        order = sorted(range(len(remaining)), key=lambda i: remaining[i])
        for k, i in enumerate(order):
            shares[i] = min(remaining[i], left // (len(order) - k))
            left -= shares[i]
    for i, r in enumerate(remaining):
        extra = min(r - shares[i], left)
        shares[i] += extra
        left -= extra
    return shares
