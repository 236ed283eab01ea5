"""PoolOffload: moves whole blocks between one model's KV pool and the TierManager.

The pool is `k_pool, v_pool: [num_layers, num_blocks, block_size, num_kv_heads, head_dim]`; block b is
`k_pool[:, b]`. The BlockManager calls `offer` / `contains` / `fetch` (prefix cache) and the scheduler calls
`swap_out` / `swap_in` (preemption); everything else about tiers stays in the TierManager.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from .host_tier import copy_block
from .tier_manager import TierManager


class PoolOffload:
    """The bridge between a device KV pool and its tiers."""

    def __init__(self, tiers: TierManager, k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
        if k_pool.shape != v_pool.shape or tuple(k_pool.shape[2:]) != tiers.layout.shape[1:] \
                or k_pool.shape[0] != tiers.layout.num_layers:
            raise ValueError(f"KV pool of shape {tuple(k_pool.shape)} does not match layout {tiers.layout.shape}")
        self.tiers = tiers
        self.k_pool = k_pool
        self.v_pool = v_pool

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

    # --- swap ---------------------------------------------------------------

    def swap_out(self, seq_id: Hashable, block_ids: Sequence[int]) -> bool:
        """Copy a preempted sequence's blocks to host swap space; False when the host tier cannot hold them."""
        shape = (self.k_pool.shape[0], len(block_ids), *self.k_pool.shape[2:])
        pin = self.tiers.host.pin_memory
        k = torch.empty(shape, dtype=self.k_pool.dtype, pin_memory=pin)
        v = torch.empty(shape, dtype=self.v_pool.dtype, pin_memory=pin)
        for j, b in enumerate(block_ids):
            copy_block(k[:, j], self.k_pool[:, b])
            copy_block(v[:, j], self.v_pool[:, b])
        return self.tiers.swap_out(seq_id, k, v, copy=False)

    def swap_in(self, seq_id: Hashable, block_ids: Sequence[int]) -> bool:
        """Copy a swapped sequence back into pool blocks `block_ids` (same count as swapped out); False if absent."""
        kv = self.tiers.swap_in(seq_id)
        if kv is None:
            return False
        k, v = kv
        if k.shape[1] != len(block_ids):
            raise ValueError(f"{seq_id!r} swapped {k.shape[1]} blocks, {len(block_ids)} given back")
        for j, b in enumerate(block_ids):
            copy_block(self.k_pool[:, b], k[:, j])
            copy_block(self.v_pool[:, b], v[:, j])
        return True

    def drop_swap(self, seq_id: Hashable) -> None:
        """Forget a swapped sequence (it was aborted while waiting)."""
        self.tiers.drop_swap(seq_id)
