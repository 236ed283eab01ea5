"""Recurrent-state slots for linear-attention layers (Gated DeltaNet): the cache those layers need instead of KV.

A sequence holds one slot for its whole life; the slot holds, for every linear layer, the conv state (the last
K - 1 inputs of the causal convolution) and the recurrent state (per value head a k_dim x v_dim matrix), whatever
the sequence's length. The pools are preallocated like the KV pool, and a slot's number is what the kernels take
(kernels.gated_delta: `slots`). Copying a slot into another snapshots a sequence's state (for prefix-cache entries
and speculation rollback).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from edgeserve.kernels.gated_delta import DeltaBatch, DeltaNetDims


class OutOfSlotsError(RuntimeError):
    """No free state slot (callers check `can_allocate` first)."""


@dataclass(frozen=True)
class StateSpec:
    """What one slot holds: the states of `num_layers` linear layers of shape `dims`."""

    num_layers: int
    dims: DeltaNetDims
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError("num_layers must be positive")

    @property
    def conv_shape(self) -> tuple[int, int]:
        """One layer's conv state: [K - 1, conv_dim], oldest input first."""
        return (self.dims.conv_kernel - 1, self.dims.conv_dim)

    @property
    def recurrent_shape(self) -> tuple[int, int, int]:
        """One layer's recurrent state: [Hv, Dk, Dv]."""
        return (self.dims.num_v_heads, self.dims.head_k_dim, self.dims.head_v_dim)

    @property
    def bytes_per_sequence(self) -> int:
        """Bytes of one slot over all layers (what a sequence costs, at any length)."""
        values = math.prod(self.conv_shape) + math.prod(self.recurrent_shape)
        return self.num_layers * values * torch.empty((), dtype=self.dtype).element_size()


def slots_for_budget(budget_bytes: float, spec: StateSpec) -> int:
    """How many slots fit in `budget_bytes`."""
    return int(budget_bytes // spec.bytes_per_sequence)


class StatePool:
    """`num_slots` preallocated slots of conv [num_slots, num_layers, K - 1, conv_dim] and recurrent
    [num_slots, num_layers, Hv, Dk, Dv] state, handed out and taken back by slot number."""

    def __init__(self, spec: StateSpec, num_slots: int, device: torch.device | str = "cpu") -> None:
        if num_slots < 1:
            raise ValueError("num_slots must be positive")
        self.spec = spec
        self.num_slots = num_slots
        self.conv = torch.zeros(num_slots, spec.num_layers, *spec.conv_shape, dtype=spec.dtype, device=device)
        self.recurrent = torch.zeros(num_slots, spec.num_layers, *spec.recurrent_shape, dtype=spec.dtype,
                                     device=device)
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # a stack: the lowest slot goes out first
        self._used: set[int] = set()

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
            self.conv[slot].zero_()
            self.recurrent[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        """Give a slot back; freeing a slot that is not in use is an error (a double free)."""
        if slot not in self._used:
            raise ValueError(f"state slot {slot} is not in use")
        self._used.remove(slot)
        self._free.append(slot)

    def copy(self, src: int, dst: int) -> None:
        """Make slot `dst` (in use) hold the states of slot `src` (in use): a snapshot, or a rollback to one."""
        for s in (src, dst):
            if s not in self._used:
                raise ValueError(f"state slot {s} is not in use")
        if src != dst:
            self.conv[dst].copy_(self.conv[src])
            self.recurrent[dst].copy_(self.recurrent[src])

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Linear layer `index`'s (conv [num_slots, K - 1, conv_dim], recurrent [num_slots, Hv, Dk, Dv]) views, as
        the kernels take them."""
        if not 0 <= index < self.spec.num_layers:
            raise IndexError(f"linear layer {index} out of range 0..{self.spec.num_layers - 1}")
        return self.conv[:, index], self.recurrent[:, index]

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
        assert self.num_free + self.num_used == self.num_slots


@dataclass
class StepStates:
    """One step's recurrent states as a hybrid model reads them (models.qwen35.RecurrentStates): the ragged batch
    of the step's sequences with their slots, over `pool`."""

    pool: StatePool
    batch: "DeltaBatch"

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Linear layer `index`'s (conv, recurrent) pool views."""
        return self.pool.layer(index)

    @classmethod
    def build(cls, pool: StatePool, cu_seqlens, slots) -> "StepStates":
        """The states of a step whose sequence i owns rows cu_seqlens[i]:cu_seqlens[i + 1] and slot slots[i]
        (tensors or host lists: lists are checked on the host and the batch is sent to the pool's device in one go,
        so a GPU step waits on nothing here)."""
        batch = DeltaBatch.build(cu_seqlens, slots, pool.num_slots)
        dev = pool.recurrent.device
        if batch.seq.device != dev:
            batch = replace(batch, **{f: getattr(batch, f).to(dev, non_blocking=True)
                                      for f in ("cu_seqlens", "slots", "seq", "pos", "lens")})
        return cls(pool, batch)
