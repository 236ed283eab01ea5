"""Host-memory tier: cached KV blocks, hybrid models' state snapshots and swapped-out sequences under one byte
budget, LRU."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable

import torch


@dataclass
class HostBlock:
    """A cached full block kept in host memory, with the prefix-cache key it had on the device."""

    block_hash: bytes
    parent_hash: bytes
    token_ids: tuple[int, ...]
    k: torch.Tensor
    v: torch.Tensor
    on_disk: bool = False  # a copy is already in the disk tier (no need to write it again)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


@dataclass
class HostState:
    """A hybrid model's recurrent-state snapshot after the block `block_hash`, kept in host memory as its bytes."""

    block_hash: bytes
    data: torch.Tensor  # uint8, layout.state_nbytes
    on_disk: bool = False

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


Entry = HostBlock | HostState


def _state_key(block_hash: bytes) -> tuple[str, bytes]:
    """A state's key in the LRU order it shares with blocks (blocks are keyed by their bare hash)."""
    return ("state", block_hash)


def copy_block(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)` for a block; between CPU tensors a plain single-threaded memcpy through numpy.

    A block is a few hundred KiB: torch's parallel copy gains nothing there, and on a busy machine its
    thread-pool handoff costs milliseconds per call (measured: 11 ms vs 0.02 ms on a loaded 2-core box).
    """
    if dst.device.type == "cpu" and src.device.type == "cpu" and dst.dtype == src.dtype and dst.shape == src.shape \
            and dst.stride(-1) == 1 and src.stride(-1) == 1:
        dst.view(torch.uint8).numpy()[...] = src.view(torch.uint8).numpy()
    else:
        dst.copy_(src, non_blocking=dst.device.type == "cuda" or src.is_pinned())


def pack_bytes(dst: torch.Tensor, views: list[torch.Tensor]) -> None:
    """Copy the bytes of `views` (contiguous tensors), one after another, into `dst` (uint8, exactly as long)."""
    off = 0
    for t in views:
        n = t.nbytes
        copy_block(dst[off:off + n], t.detach().reshape(-1).view(torch.uint8))
        off += n
    if off != dst.numel():
        raise ValueError(f"{off} bytes of state do not fill {dst.numel()}")


def unpack_bytes(views: list[torch.Tensor], src: torch.Tensor) -> None:
    """Copy `src` (uint8) back into `views` (contiguous tensors that `pack_bytes` packed), in order."""
    if sum(t.nbytes for t in views) != src.numel():
        raise ValueError(f"{src.numel()} bytes of state do not fit the pool's {sum(t.nbytes for t in views)}")
    off = 0
    for t in views:
        n = t.nbytes
        copy_block(t.reshape(-1).view(torch.uint8), src[off:off + n])
        off += n


def host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """A host-memory copy of `t` that owns its storage (pinned when `pin`), contiguous."""
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    copy_block(out, t.detach())
    return out


class HostTier:
    """Blocks and state snapshots keyed by hash (one LRU order) plus swap entries keyed by sequence id; all count
    against `capacity_bytes`.

    Cached blocks and states are evicted least recently used first to make room; swap entries are never evicted
    (they are the only copy of a preempted request's KV and state) and are refused when they do not fit.
    """

    def __init__(self, capacity_bytes: int, pin_memory: bool | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.capacity_bytes = capacity_bytes
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        # blocks by hash and states by _state_key(hash), least recently used first
        self._blocks: OrderedDict[bytes | tuple[str, bytes], Entry] = OrderedDict()
        self._num_states = 0
        self._swaps: dict[Hashable, tuple[torch.Tensor, ...]] = {}  # (k, v) or (k, v, state)
        self.used_bytes = 0

    # --- queries ---------------------------------------------------------

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    @property
    def num_blocks(self) -> int:
        """Cached blocks held (swap entries and states not counted)."""
        return len(self._blocks) - self._num_states

    @property
    def num_states(self) -> int:
        """State snapshots held."""
        return self._num_states

    @property
    def num_swapped(self) -> int:
        """Sequences whose KV is swapped out here."""
        return len(self._swaps)

    @property
    def swap_bytes(self) -> int:
        """Bytes held by swap entries."""
        return sum(t.nbytes for entry in self._swaps.values() for t in entry)

    def has_swap(self, seq_id: Hashable) -> bool:
        """Whether `seq_id` has a swap entry."""
        return seq_id in self._swaps

    def get(self, block_hash: bytes) -> HostBlock | None:
        """The cached block for `block_hash` (marked most recently used), or None."""
        block = self._blocks.get(block_hash)
        if block is not None:
            self._blocks.move_to_end(block_hash)
        return block

    def blocks(self) -> list[HostBlock]:
        """Every cached block, least recently used first."""
        return [e for e in self._blocks.values() if isinstance(e, HostBlock)]

    def states(self) -> list[HostState]:
        """Every state snapshot, least recently used first."""
        return [e for e in self._blocks.values() if isinstance(e, HostState)]

    def has_state(self, block_hash: bytes) -> bool:
        """Whether the state snapshot after block `block_hash` is here."""
        return _state_key(block_hash) in self._blocks

    def get_state(self, block_hash: bytes) -> HostState | None:
        """The state snapshot after block `block_hash` (marked most recently used), or None."""
        key = _state_key(block_hash)
        state = self._blocks.get(key)
        if state is not None:
            self._blocks.move_to_end(key)
        return state

    def put_state(self, state: HostState) -> list[Entry] | None:
        """Add a state snapshot (its data already a host copy); return the entries evicted for it, None if refused."""
        key = _state_key(state.block_hash)
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return []
        evicted = self.make_room(state.nbytes)
        if evicted is None:
            return None
        self._blocks[key] = state
        self._num_states += 1
        self.used_bytes += state.nbytes
        return evicted

    # --- cached blocks ----------------------------------------------------

    def make_room(self, nbytes: int) -> list[Entry] | None:
        """Evict LRU cached blocks and states until `nbytes` more fit; return them, or None (nothing evicted) if it
        cannot fit."""
        if nbytes > self.capacity_bytes - self.swap_bytes:
            return None
        evicted = []
        while self.used_bytes + nbytes > self.capacity_bytes:
            _, entry = self._blocks.popitem(last=False)
            self.used_bytes -= entry.nbytes
            self._num_states -= isinstance(entry, HostState)
            evicted.append(entry)
        return evicted

    def put(self, block: HostBlock) -> list[Entry] | None:
        """Add a block (its tensors must already be host copies); return the blocks evicted for it, None if refused."""
        if block.block_hash in self._blocks:
            self._blocks.move_to_end(block.block_hash)
            return []
        evicted = self.make_room(block.nbytes)
        if evicted is None:
            return None
        self._blocks[block.block_hash] = block
        self.used_bytes += block.nbytes
        return evicted

    def pop(self, block_hash: bytes) -> HostBlock | None:
        """Remove and return a cached block, or None."""
        block = self._blocks.pop(block_hash, None)
        if block is not None:
            self.used_bytes -= block.nbytes
        return block

    # --- swap space --------------------------------------------------------

    def put_swap(self, seq_id: Hashable, k: torch.Tensor, v: torch.Tensor, copy: bool = True,
                 state: torch.Tensor | None = None) -> list[Entry] | None:
        """Store a host copy of a sequence's KV (and `state`: a hybrid's recurrent state; `copy=False`: keep these
        host tensors as they are), evicting cached entries for room; return them, or None if it cannot fit."""
        if seq_id in self._swaps:
            raise ValueError(f"sequence {seq_id!r} is already swapped out")
        entry = (k, v) if state is None else (k, v, state)
        evicted = self.make_room(sum(t.nbytes for t in entry))
        if evicted is None:
            return None
        if copy or any(t.device.type != "cpu" for t in entry):
            entry = tuple(host_copy(t, self.pin_memory) for t in entry)
        self._swaps[seq_id] = entry
        self.used_bytes += sum(t.nbytes for t in entry)
        return evicted

    def pop_swap(self, seq_id: Hashable) -> tuple[torch.Tensor, ...] | None:
        """Remove and return a sequence's swapped (k, v) (with a hybrid's state: (k, v, state)), or None."""
        entry = self._swaps.pop(seq_id, None)
        if entry is not None:
            self.used_bytes -= sum(t.nbytes for t in entry)
        return entry
