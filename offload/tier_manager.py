"""TierManager: where a KV block (or a hybrid's state snapshot) evicted from the main pool goes (host, then disk) and
how it comes back."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Hashable

import torch

from .config import OffloadConfig
from .disk_tier import DiskTier
from .host_tier import Entry, HostBlock, HostState, HostTier, copy_block, host_copy, pack_bytes, unpack_bytes
from .layout import KVLayout

CPU, DISK = "cpu", "disk"


@dataclass
class OffloadStats:
    """A snapshot of the tiers' counters (for /metrics and status)."""

    host_blocks: int = 0
    disk_blocks: int = 0
    host_bytes: int = 0
    disk_bytes: int = 0
    host_hits: int = 0
    disk_hits: int = 0
    misses: int = 0  # load() calls that found nothing usable (corrupt disk blocks included)
    bytes_device_to_host: int = 0  # saved blocks and swap-outs
    bytes_host_to_disk: int = 0
    bytes_host_to_device: int = 0  # host hits and swap-ins
    bytes_disk_to_device: int = 0
    swap_outs: int = 0
    swap_ins: int = 0
    swap_out_failures: int = 0  # host tier full: the caller recomputes instead
    corrupt_blocks: int = 0  # state files included
    disk_enabled: bool = False
    # hybrid models' recurrent-state snapshots (kept beside the blocks they end at)
    host_states: int = 0
    disk_states: int = 0
    states_saved: int = 0  # snapshots handed down from the device
    state_host_hits: int = 0
    state_disk_hits: int = 0
    state_misses: int = 0  # load_state() calls that found nothing usable (corrupt files included)


class TierManager:
    """Host tier (LRU, optional) over a disk tier (optional); blocks keep their prefix hash in every tier."""

    def __init__(self, layout: KVLayout, host_bytes: int = 0, disk_root: str | os.PathLike[str] | None = None,
                 disk_bytes: int = 0, pin_memory: bool | None = None, fsync: bool = False) -> None:
        self.layout = layout
        self.host = HostTier(host_bytes, pin_memory)
        self.disk = DiskTier(disk_root, layout, disk_bytes, fsync=fsync) if disk_root is not None else None
        self._stats = OffloadStats()

    @classmethod
    def from_config(cls, config: OffloadConfig, layout: KVLayout) -> TierManager | None:
        """A manager for `config`, or None when offload is off."""
        if not config.use_cpu:
            return None
        return cls(layout, host_bytes=config.cpu_kv_bytes,
                   disk_root=config.disk_path if config.use_disk else None, disk_bytes=config.disk_kv_bytes)

    @property
    def _disk_on(self) -> bool:
        return self.disk is not None and self.disk.enabled

    # --- cached blocks ----------------------------------------------------

    def save(self, block_hash: bytes, parent_hash: bytes, token_ids: tuple[int, ...],
             k: torch.Tensor, v: torch.Tensor) -> str | None:
        """Take a block the main pool is evicting (`k`, `v`: [layers, block_size, kv_heads, head_dim]), copying it
        before the caller overwrites it; return the tier that now holds it, or None."""
        if block_hash in self.host:
            self.host.get(block_hash)
            return CPU
        # only a copy known whole counts: an unread file may be damaged, and then this block is written again
        on_disk = self.disk is not None and self.disk.verified(block_hash)
        block = HostBlock(block_hash, parent_hash, tuple(token_ids), host_copy(k, self.host.pin_memory),
                          host_copy(v, self.host.pin_memory), on_disk=on_disk)
        evicted = self.host.put(block)
        if evicted is None:  # no room in host memory at all: straight to disk
            return DISK if self._demote(block) else None
        self._stats.bytes_device_to_host += block.nbytes
        for old in evicted:
            self._demote(old)
        return CPU

    def lookup(self, block_hash: bytes) -> str | None:
        """The fastest tier that claims `block_hash` ("cpu" or "disk"), or None (a disk block is verified on load)."""
        if block_hash in self.host:
            return CPU
        if self.disk is not None and block_hash in self.disk:
            return DISK
        return None

    def load(self, block_hash: bytes) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A block's (k, v) from the fastest tier, verified; None on a miss. Treat the tensors as read-only."""
        block = self.host.get(block_hash)
        if block is not None:
            self._stats.host_hits += 1
            self._stats.bytes_host_to_device += block.nbytes
            return block.k, block.v
        if self.disk is not None:
            found = self.disk.get(block_hash)
            if found is not None:
                self._stats.disk_hits += 1
                self._stats.bytes_disk_to_device += found.k.nbytes + found.v.nbytes
                return found.k, found.v
        self._stats.misses += 1
        return None

    def load_into(self, block_hash: bytes, k_dst: torch.Tensor, v_dst: torch.Tensor) -> bool:
        """Copy a block into the destination views (e.g. `k_pool[:, b]`); False on a miss (nothing written)."""
        kv = self.load(block_hash)
        if kv is None:
            return False
        copy_block(k_dst, kv[0])
        copy_block(v_dst, kv[1])
        return True

    # --- state snapshots (hybrid models) ------------------------------------

    def save_state(self, block_hash: bytes, views: list[torch.Tensor]) -> str | None:
        """Take a state snapshot the device lets go of (`views`: its tensors, whose bytes one after another are the
        snapshot), copying it; return the tier that now holds it, or None."""
        if self.host.has_state(block_hash):
            self.host.get_state(block_hash)
            return CPU
        data = torch.empty(self.layout.state_nbytes, dtype=torch.uint8, pin_memory=self.host.pin_memory)
        pack_bytes(data, views)
        on_disk = self.disk is not None and self.disk.states.whole(block_hash)
        state = HostState(block_hash, data, on_disk=on_disk)
        self._stats.states_saved += 1
        evicted = self.host.put_state(state)
        if evicted is None:
            return DISK if self._demote(state) else None
        self._stats.bytes_device_to_host += state.nbytes
        for old in evicted:
            self._demote(old)
        return CPU

    def has_state(self, block_hash: bytes) -> bool:
        """Whether a tier claims the state snapshot after block `block_hash` (a disk one is verified on load)."""
        return self.host.has_state(block_hash) or (self.disk is not None and block_hash in self.disk.states)

    def load_state(self, block_hash: bytes, views: list[torch.Tensor]) -> bool:
        """Copy the state snapshot after block `block_hash` into `views` (the tensors `save_state` took), verified;
        False on a miss (nothing written)."""
        state = self.host.get_state(block_hash)
        data = None
        if state is not None:
            data = state.data
            self._stats.state_host_hits += 1
            self._stats.bytes_host_to_device += state.nbytes
        elif self.disk is not None:
            data = self.disk.get_state(block_hash)
            if data is not None:
                self._stats.state_disk_hits += 1
                self._stats.bytes_disk_to_device += data.nbytes
        if data is None:
            self._stats.state_misses += 1
            return False
        unpack_bytes(views, data)
        return True

    def flush(self) -> int:
        """Write every host block and state that is not on disk yet to disk (before shutdown); return how many were
        written."""
        written = 0
        for entry in [*self.host.blocks(), *self.host.states()]:
            if not self._on_disk(entry) and self._demote(entry):
                written += 1
        return written

    # --- swap space for preempted requests ----------------------------------

    def swap_out(self, seq_id: Hashable, k: torch.Tensor, v: torch.Tensor, copy: bool = True,
                 state: torch.Tensor | None = None) -> bool:
        """Copy a preempted sequence's KV (and `state`: a hybrid's recurrent state) to host memory (`copy=False`:
        they are fresh host tensors to keep); False (nothing kept) when the host tier cannot hold it."""
        evicted = self.host.put_swap(seq_id, k, v, copy=copy, state=state)
        if evicted is None:
            self._stats.swap_out_failures += 1
            return False
        for old in evicted:
            self._demote(old)
        self._stats.swap_outs += 1
        self._stats.bytes_device_to_host += k.nbytes + v.nbytes + (state.nbytes if state is not None else 0)
        return True

    def swap_in(self, seq_id: Hashable) -> tuple[torch.Tensor, ...] | None:
        """Take back a swapped-out sequence's (k, v) (with a state: (k, v, state)); the host copy is released; None if
        it was not swapped."""
        entry = self.host.pop_swap(seq_id)
        if entry is not None:
            self._stats.swap_ins += 1
            self._stats.bytes_host_to_device += sum(t.nbytes for t in entry)
        return entry

    def drop_swap(self, seq_id: Hashable) -> None:
        """Release a swapped-out sequence's KV without reading it (the request was aborted)."""
        self.host.pop_swap(seq_id)

    def is_swapped(self, seq_id: Hashable) -> bool:
        """Whether `seq_id` has KV in swap space."""
        return self.host.has_swap(seq_id)

    # --- counters ----------------------------------------------------------

    def stats(self) -> OffloadStats:
        """A copy of the counters with the current occupancy filled in."""
        s = OffloadStats(**vars(self._stats))
        s.host_blocks, s.host_bytes, s.host_states = self.host.num_blocks, self.host.used_bytes, self.host.num_states
        if self.disk is not None:
            s.disk_blocks, s.disk_bytes = self.disk.num_blocks, self.disk.used_bytes
            s.disk_states = len(self.disk.states)
            s.corrupt_blocks, s.disk_enabled = self.disk.num_corrupt, self.disk.enabled
        return s

    # --- internals -------------------------------------------------------

    def _on_disk(self, entry: Entry) -> bool:
        """Whether a host entry's copy on disk is still there."""
        if not entry.on_disk or self.disk is None:
            return False
        return entry.block_hash in self.disk.states if isinstance(entry, HostState) else entry.block_hash in self.disk

    def _demote(self, entry: Entry) -> bool:
        """Move a block or state the host tier let go of down to disk (once); True if it is on disk."""
        if self._on_disk(entry):
            return True
        if not self._disk_on:
            return False
        if isinstance(entry, HostState):
            stored = self.disk.put_state(entry.block_hash, entry.data)
        else:
            stored = self.disk.put(entry.block_hash, entry.parent_hash, entry.token_ids, entry.k, entry.v)
        if stored:
            entry.on_disk = True
            self._stats.bytes_host_to_disk += entry.nbytes
        return stored
