"""Recurrent-state slots for a hybrid model's state layers (Gated DeltaNet today; short-conv and Mamba-2 kinds are
declared here too): the cache those layers need instead of KV.

A layer *kind* declares the named tensors one layer keeps per sequence (`LayerStateKind`: Gated DeltaNet's conv
[K - 1, conv_dim] and recurrent [Hv, Dk, Dv]; a short convolution's conv [K - 1, C]; Mamba-2's conv and ssm
[H, head_dim, N]), and a `StateSpec` is `num_layers` layers of one kind. A sequence holds one slot for its whole
life; the slot holds every declared tensor for every layer, whatever the sequence's length. The pools are
preallocated like the KV pool (one tensor [num_slots, num_layers, *shape] per declared name), and a slot's number
is what the kernels take (kernels.torch.gated_delta: `slots`). Copying a slot into another snapshots a sequence's state
(for prefix-cache entries and speculation rollback). The offload tiers store a slot as the bytes of its tensors in
declared order (`StatePool.slot_views`), under the spec's `format` string, so they keep whatever a kind declares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from edgeserve.kernels.torch.gated_delta import DeltaBatch, DeltaNetDims

from .cache_spec import state_layers


class OwedRows(Protocol):
    """Rows a slot's states have not taken yet (StatePool.owe): kernels.cpu.recurrent_step.OwedDrafts."""

    n: int  # how many

    def settle(self, pool: StatePool, slot: int, rows: int | None = None) -> OwedRows | None:
        """Advance slot `slot`'s states in `pool` by the rows (the first `rows` of them), now; the rest, if any."""


class OutOfSlotsError(RuntimeError):
    """No free state slot (callers check `can_allocate` first)."""


@dataclass(frozen=True)
class StateTensor:
    """One named tensor a layer keeps per sequence: its shape for one layer of one slot (`dtype`: None for the
    spec's dtype)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or not self.shape or min(self.shape) < 1:
            raise ValueError(f"a state tensor needs a name and a positive shape: {self}")


@dataclass(frozen=True)
class LayerStateKind:
    """What one layer of a kind keeps per sequence: its named tensors, in order (the first one is what `layer`
    returns first)."""

    name: str  # "gated_delta" | "short_conv" | "mamba2" | ...
    tensors: tuple[StateTensor, ...]

    def __post_init__(self) -> None:
        names = [t.name for t in self.tensors]
        if not self.tensors or len(set(names)) != len(names):
            raise ValueError(f"layer state kind {self.name!r} needs distinct tensor names: {names}")


def gated_delta_kind(dims: DeltaNetDims) -> LayerStateKind:
    """A Gated DeltaNet layer's state: conv [K - 1, conv_dim] (the last K - 1 inputs of the causal convolution,
    oldest first) and recurrent [Hv, Dk, Dv] (per value head a k_dim x v_dim matrix)."""
    return LayerStateKind("gated_delta", (StateTensor("conv", (dims.conv_kernel - 1, dims.conv_dim)),
                                          StateTensor("recurrent", (dims.num_v_heads, dims.head_k_dim,
                                                                    dims.head_v_dim))))


def short_conv_kind(conv_kernel: int, channels: int) -> LayerStateKind:
    """A short gated convolution layer's state (LFM2-style): conv [K - 1, channels] only."""
    return LayerStateKind("short_conv", (StateTensor("conv", (conv_kernel - 1, channels)),))


def mamba2_kind(conv_kernel: int, conv_dim: int, num_heads: int, head_dim: int, state_size: int) -> LayerStateKind:
    """A Mamba-2 layer's state: conv [K - 1, conv_dim] (x | B | C channels) and ssm [H, head_dim, N]."""
    return LayerStateKind("mamba2", (StateTensor("conv", (conv_kernel - 1, conv_dim)),
                                     StateTensor("ssm", (num_heads, head_dim, state_size))))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class StateSpec:
    """What one slot holds: `num_layers` layers of one state kind. `kind` may be given as a DeltaNetDims (a Gated
    DeltaNet layer's shape), which is what `StateSpec(num_linear_layers, config.delta)` means."""

    num_layers: int
    kind: LayerStateKind | DeltaNetDims
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError("num_layers must be positive")
        if isinstance(self.kind, DeltaNetDims):
            object.__setattr__(self, "kind", gated_delta_kind(self.kind))

    @property
    def tensors(self) -> tuple[StateTensor, ...]:
        """The named tensors one layer keeps, in order."""
        return self.kind.tensors

    def tensor_dtype(self, t: StateTensor) -> torch.dtype:
        """The dtype tensor `t` is kept in."""
        return t.dtype or self.dtype

    def shape(self, name: str) -> tuple[int, ...]:
        """One layer's shape of the tensor `name`."""
        for t in self.tensors:
            if t.name == name:
                return t.shape
        raise KeyError(f"state kind {self.kind.name!r} has no tensor {name!r}")

    @property
    def conv_shape(self) -> tuple[int, ...]:
        """One layer's conv state: [K - 1, conv_dim], oldest input first."""
        return self.shape("conv")

    @property
    def recurrent_shape(self) -> tuple[int, ...]:
        """One layer's recurrent state (Gated DeltaNet): [Hv, Dk, Dv]."""
        return self.shape("recurrent")

    @property
    def bytes_per_sequence(self) -> int:
        """Bytes of one slot over all layers (what a sequence costs, at any length)."""
        return self.num_layers * sum(math.prod(t.shape) * _itemsize(self.tensor_dtype(t)) for t in self.tensors)

    @property
    def format(self) -> str:
        """A stable description of a slot's bytes (kind, layers, tensors, dtypes): what a stored state must match."""
        parts = [f"{t.name}:{'x'.join(map(str, t.shape))}:{str(self.tensor_dtype(t)).removeprefix('torch.')}"
                 for t in self.tensors]
        return f"{self.kind.name}/{self.num_layers}/{','.join(parts)}"


def state_spec_for(config) -> StateSpec:
    """The state spec of a hybrid model (a models.config.ModelConfig with `is_hybrid`): how many state layers it
    has and the kind each keeps: the config's `layer_state` (its architecture's `state_kind`, e.g. LFM2's
    short_conv_kind, else Gated DeltaNet's `delta`)."""
    count, kind = state_layers(config)
    if not count:
        raise ValueError(f"{config.architecture} has no state layers")
    return StateSpec(count, kind)


def slots_for_budget(budget_bytes: float, spec: StateSpec) -> int:
    """How many slots fit in `budget_bytes`."""
    return int(budget_bytes // spec.bytes_per_sequence)


class StatePool:
    """`num_slots` preallocated slots: for each tensor the spec declares (e.g. conv, recurrent) one pool
    [num_slots, num_layers, *shape], reachable as `tensors[name]` or as the attribute `name` (`pool.conv`), handed
    out and taken back by slot number."""

    def __init__(self, spec: StateSpec, num_slots: int, device: torch.device | str = "cpu") -> None:
        if num_slots < 1:
            raise ValueError("num_slots must be positive")
        self.spec = spec
        self.num_slots = num_slots
        self.tensors: dict[str, torch.Tensor] = {
            t.name: torch.zeros(num_slots, spec.num_layers, *t.shape, dtype=spec.tensor_dtype(t), device=device)
            for t in spec.tensors}
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # a stack: the lowest slot goes out first
        self._used: set[int] = set()
        # rows a slot's states have not taken yet (a verification's accepted drafts, kernels.cpu.recurrent_step):
        # its sequence's next fused step runs them (`take_owed`); every other read of the slot settles them first
        self.owed: dict[int, OwedRows] = {}

    def __getattr__(self, name: str) -> torch.Tensor:
        tensors = self.__dict__.get("tensors")
        if tensors is not None and name in tensors:
            return tensors[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors.values())).device

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int = 1) -> bool:
        """Whether `n` slots are free."""
        return n <= len(self._free)

    def allocate(self, zero: bool = True) -> int:
        """A free slot with zeroed states (a fresh sequence's start; `zero=False`: as they are, for a slot about to be
        overwritten by `copy`); raises OutOfSlotsError when none is free."""
        if not self._free:
            raise OutOfSlotsError(f"all {self.num_slots} state slots are in use")
        slot = self._free.pop()
        self._used.add(slot)
        if zero:
            for t in self.tensors.values():
                t[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        """Give a slot back (rows it still owed go with its states); freeing a slot that is not in use is an error
        (a double free)."""
        if slot not in self._used:
            raise ValueError(f"state slot {slot} is not in use")
        self.owed.pop(slot, None)
        self._used.remove(slot)
        self._free.append(slot)

    def owe(self, slot: int, rows: OwedRows) -> None:
        """Record rows that slot `slot`'s states still have to take (after any it owed already)."""
        if slot not in self._used:
            raise ValueError(f"state slot {slot} is not in use")
        self.settle(slot)
        self.owed[slot] = rows

    def settle(self, slot: int | None = None, leave: int = 0) -> bool:
        """Make slot `slot`'s states (None: every slot's) take the rows they owe, now, all but the last `leave` of
        them (which stay owed: the states then stand `leave` tokens before their sequence). False when the slot owes
        fewer than `leave` rows (nothing changes)."""
        if leave:
            rows = self.owed.get(slot)
            if rows is None or rows.n < leave:
                return False
            if rows.n > leave:
                self.owed[slot] = rows.settle(self, slot, rows.n - leave)
            return True
        for s in [slot] if slot is not None else list(self.owed):
            rows = self.owed.pop(s, None)
            if rows is not None:
                rows.settle(self, s)
        return True

    def take_owed(self, slots: list[int]) -> list[OwedRows | None]:
        """The rows each of `slots` owes (None where none), handed to a step that runs them before its own rows:
        they are no longer owed here."""
        return [self.owed.pop(s, None) for s in slots]

    def copy(self, src: int, dst: int, settle: bool = True) -> None:
        """Make slot `dst` (in use) hold the states of slot `src` (in use): a snapshot, or a rollback to one. `src`
        takes the rows it owes first (`settle`; False: the copy is of its states as they stand)."""
        for s in (src, dst):
            if s not in self._used:
                raise ValueError(f"state slot {s} is not in use")
        if settle:
            self.settle(src)
        if src != dst:
            self.owed.pop(dst, None)
            for t in self.tensors.values():
                t[dst].copy_(t[src])

    def slot_views(self, slot: int) -> list[torch.Tensor]:
        """Slot `slot`'s tensors ([num_layers, *shape] each, contiguous views), in the spec's order: what the
        offload tiers copy (as bytes, one after another)."""
        self.settle(slot)
        return [self.tensors[t.name][slot] for t in self.spec.tensors]

    def layer(self, index: int) -> tuple[torch.Tensor, ...]:
        """Layer `index`'s views of every declared tensor ([num_slots, *shape] each), in the spec's order, as the
        kernels take them: Gated DeltaNet's (conv [num_slots, K - 1, conv_dim], recurrent [num_slots, Hv, Dk, Dv])."""
        if not 0 <= index < self.spec.num_layers:
            raise IndexError(f"state layer {index} out of range 0..{self.spec.num_layers - 1}")
        self.settle()
        return tuple(self.tensors[t.name][:, index] for t in self.spec.tensors)

    @property
    def nbytes(self) -> int:
        """Bytes the pools hold."""
        return self.num_slots * self.spec.bytes_per_sequence

    def check(self) -> None:
        """Raise AssertionError unless every slot is exactly one of free or used (the bookkeeping is sound)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a slot is free twice"
        assert not free & self._used, f"slots both free and used: {sorted(free & self._used)[:8]}"
        assert free | self._used == set(range(self.num_slots)), "a slot is lost or out of range"
        assert set(self.owed) <= self._used, "rows owed to a free slot"
        assert self.num_free + self.num_used == self.num_slots


@dataclass
class StepStates:
    """One step's recurrent states as a hybrid model reads them (models.qwen35.RecurrentStates): the ragged batch
    of the step's sequences with their slots, over `pool`."""

    pool: StatePool
    batch: "DeltaBatch"
    # a verification step's drafts: sequence i's first keep[i] rows advance its states, the rest are computed on a
    # copy and their inputs kept for a replay of the accepted ones (only a plan whose mixers do that takes such a
    # step, and sets `kept`); None: every row advances the states
    keep: list[int] | None = None
    kept: bool = False

    def layer(self, index: int) -> tuple[torch.Tensor, ...]:
        """Layer `index`'s pool views (Gated DeltaNet: conv, recurrent)."""
        return self.pool.layer(index)

    @classmethod
    def build(cls, pool: StatePool, cu_seqlens, slots, keep: list[int] | None = None) -> "StepStates":
        """The states of a step whose sequence i owns rows cu_seqlens[i]:cu_seqlens[i + 1] and slot slots[i]
        (tensors or host lists: lists are checked on the host and the batch is sent to the pool's device in one go,
        so a GPU step waits on nothing here)."""
        batch = DeltaBatch.build(cu_seqlens, slots, pool.num_slots)
        dev = pool.device
        if batch.seq.device != dev:
            batch = replace(batch, **{f: getattr(batch, f).to(dev, non_blocking=True)
                                      for f in ("cu_seqlens", "slots", "seq", "pos", "lens")})
        return cls(pool, batch, keep)
