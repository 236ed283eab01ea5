"""PoolOffload: moves whole blocks between one model's KV pool and the TierManager.

The pool is `k_pool, v_pool: [num_layers, num_blocks, block_size, num_kv_heads, head_dim]`; block b is
`k_pool[:, b]`. The BlockManager calls `offer` / `contains` / `fetch` (prefix cache) and the scheduler calls
`swap_out` / `swap_in` (preemption); everything else about tiers stays in the TierManager.

A hybrid model's recurrent-state pool (engine.cache.state_pool.StatePool: anything with `slot_views(slot)` and a
`spec.bytes_per_sequence`) rides along: its snapshots go down and come back by the hash of the block they end at
(`offer_state` / `contains_state` / `fetch_state`, called by engine.cache.state_cache), and a preempted sequence's state
is swapped with its KV.
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

import torch

from .host_tier import copy_block, pack_bytes, unpack_bytes
from .tier_manager import TierManager


class PoolOffload:
    """The bridge between a device KV pool and its tiers."""

    def __init__(self, tiers: TierManager, k_pool: torch.Tensor, v_pool: torch.Tensor, state_pool: Any = None) -> None:
        if k_pool.shape != v_pool.shape or tuple(k_pool.shape[2:]) != tiers.layout.shape[1:] \
                or k_pool.shape[0] != tiers.layout.num_layers:
            raise ValueError(f"KV pool of shape {tuple(k_pool.shape)} does not match layout {tiers.layout.shape}")
        if state_pool is not None and state_pool.spec.bytes_per_sequence != tiers.layout.state_nbytes:
            raise ValueError("the state pool does not match the layout's state format")
        self.tiers = tiers
        self.k_pool = k_pool
        self.v_pool = v_pool
        self.state_pool = state_pool

    # --- prefix cache -------------------------------------------------------

    def offer(self, block_id: int, block_hash: bytes, parent_hash: bytes, token_ids: tuple[int, ...]) -> None:
        """Save a cached block the pool is about to reuse (call before its slots are overwritten)."""
        self.tiers.save(block_hash, parent_hash, token_ids, self.k_pool[:, block_id], self.v_pool[:, block_id])

    def contains(self, block_hash: bytes) -> bool:
        """Whether a tier claims the block (a disk block can still fail verification in `fetch`)."""
        return self.tiers.lookup(block_hash) is not None

    def fetch(self, block_hash: bytes, block_id: int) -> bool:
        """Copy a tier's block into pool block `block_id`; False (pool untouched) when it is missing or corrupt."""
        return self.tiers.load_into(block_hash, self.k_pool[:, block_id], self.v_pool[:, block_id])

    # --- state snapshots (hybrid models) ------------------------------------

    def offer_state(self, slot: int, block_hash: bytes) -> None:
        """Save the state snapshot in slot `slot` (the state after block `block_hash`) before the slot is reused."""
        self.tiers.save_state(block_hash, self.state_pool.slot_views(slot))

    def contains_state(self, block_hash: bytes) -> bool:
        """Whether a tier claims the state snapshot after block `block_hash`."""
        return self.tiers.has_state(block_hash)

    def fetch_state(self, block_hash: bytes, slot: int) -> bool:
        """Copy a tier's state snapshot into slot `slot`; False (slot untouched) when it is missing or corrupt."""
        return self.tiers.load_state(block_hash, self.state_pool.slot_views(slot))

    # --- swap ---------------------------------------------------------------

    def swap_out(self, seq_id: Hashable, block_ids: Sequence[int], state_slot: int | None = None) -> bool:
        """Copy a preempted sequence's blocks (and a hybrid's state slot `state_slot`) to host swap space; False when
        the host tier cannot hold them."""
        shape = (self.k_pool.shape[0], len(block_ids), *self.k_pool.shape[2:])
        pin = self.tiers.host.pin_memory
        k = torch.empty(shape, dtype=self.k_pool.dtype, pin_memory=pin)
        v = torch.empty(shape, dtype=self.v_pool.dtype, pin_memory=pin)
        for j, b in enumerate(block_ids):
            copy_block(k[:, j], self.k_pool[:, b])
            copy_block(v[:, j], self.v_pool[:, b])
        state = None
        if state_slot is not None:
            state = torch.empty(self.state_pool.spec.bytes_per_sequence, dtype=torch.uint8, pin_memory=pin)
            pack_bytes(state, self.state_pool.slot_views(state_slot))
        return self.tiers.swap_out(seq_id, k, v, copy=False, state=state)

    def swap_in(self, seq_id: Hashable, block_ids: Sequence[int], state_slot: int | None = None) -> bool:
        """Copy a swapped sequence back into pool blocks `block_ids` (same count as swapped out) and its state into
        slot `state_slot` (a hybrid's); False if absent."""
        entry = self.tiers.swap_in(seq_id)
        if entry is None:
            return False
        k, v = entry[0], entry[1]
        if k.shape[1] != len(block_ids) or (state_slot is not None) != (len(entry) == 3):
            raise ValueError(f"{seq_id!r} swapped {k.shape[1]} blocks, {len(block_ids)} given back")
        for j, b in enumerate(block_ids):
            copy_block(self.k_pool[:, b], k[:, j])
            copy_block(self.v_pool[:, b], v[:, j])
        if state_slot is not None:
            unpack_bytes(self.state_pool.slot_views(state_slot), entry[2])
        return True

    def drop_swap(self, seq_id: Hashable) -> None:
        """Forget a swapped sequence (it was aborted while waiting)."""
        self.tiers.drop_swap(seq_id)
