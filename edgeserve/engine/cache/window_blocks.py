"""The sliding-window layers' own KV blocks: one per block of the main pool while a sequence's window covers it.

A model with sliding-window layers (Gemma 2/3) keeps their K/V in a second, smaller pool. Block g of the main pool
(the global layers) is paired with window block `of_block[g]` (-1: none) that holds the same tokens' K/V for the
sliding layers. A sequence holds a reference to the window blocks of its logical blocks that its next query can
still see; blocks that every sequence's window has left behind go back to the window pool, so the sliding layers'
memory grows with the window, not with the context.

A released window block stays paired with its main block while that block is prefix-cached (the least recently
released are reused first), so a prefix hit can use it again; a hit needs the window blocks of its last `window`
tokens, and `BlockManager.allocate` shortens a hit whose window blocks are gone (recomputed, never wrong).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict


class OutOfBlocksError(RuntimeError):
    """A KV pool (the main one or the sliding-window one) has too few free blocks for a request (callers check
    `can_allocate` first)."""


class WindowBlocks:
    """The pairing of main blocks with window blocks, and the window pool's references and free list."""

    def __init__(self, window: int, block_size: int, num_blocks: int, num_main_blocks: int) -> None:
        if window <= 0 or num_blocks <= 0:
            raise ValueError("window and num_blocks must be positive")
        self.window = window
        self.block_size = block_size
        self.num_blocks = num_blocks
        # int32, read by the attention side through the buffer protocol (torch.frombuffer), no copy
        self.of_block = array("i", [-1]) * num_main_blocks
        self.owner = [-1] * num_blocks  # the main block each window block is paired with
        self.refs = [0] * num_blocks
        # unreferenced window blocks, least recently released first; paired ones may still be revived
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_used(self) -> int:
        """Window blocks some sequence holds."""
        return self.num_blocks - len(self.free)

    def first_needed(self, num_computed: int) -> int:
        """The first logical block whose tokens the next query (position `num_computed`) can still see."""
        return max(0, num_computed - self.window + 1) // self.block_size

    def has(self, main_block: int) -> bool:
        """Whether main block `main_block` has its sliding-layer K/V."""
        return self.of_block[main_block] >= 0

    def acquire(self, main_block: int) -> None:
        """Hold the window block of `main_block`, pairing a free one with it first when it has none."""
        w = self.of_block[main_block]
        if w < 0:
            if not self.free:
                raise OutOfBlocksError("the sliding-window KV pool is out of blocks")
            w, _ = self.free.popitem(last=False)
            self._unpair(w)
            self.owner[w], self.of_block[main_block] = main_block, w
        elif self.refs[w] == 0:
            del self.free[w]
        self.refs[w] += 1

    def release(self, main_block: int, cached: bool) -> None:
        """Drop one hold on `main_block`'s window block; `cached`: its tokens are a prefix-cached full block, so the
        pairing is kept for a later hit (else the window block is unpaired and handed out first)."""
        w = self.of_block[main_block]
        self.refs[w] -= 1
        if self.refs[w] == 0:
            self.free[w] = None
            if not cached:
                self._unpair(w)
                self.free.move_to_end(w, last=False)

    def drop(self, main_block: int) -> None:
        """`main_block` is about to hold other tokens: its window block (unreferenced by then) is unpaired."""
        w = self.of_block[main_block]
        if w >= 0:
            self._unpair(w)
            self.free.move_to_end(w, last=False)

    def _unpair(self, w: int) -> None:
        g = self.owner[w]
        if g >= 0:
            self.of_block[g] = -1
            self.owner[w] = -1

    def check(self, held: list[int]) -> None:
        """Raise AssertionError unless the references equal `held` (main blocks, one entry per hold) and the pairing
        and free list agree (for tests)."""
        refs = [0] * self.num_blocks
        for g in held:
            w = self.of_block[g]
            if w < 0:
                raise AssertionError(f"main block {g} is held in the window pool but has no window block")
            refs[w] += 1
        if refs != self.refs:
            raise AssertionError("window block references disagree with the sequences' holds")
        for w in range(self.num_blocks):
            if (self.refs[w] == 0) != (w in self.free):
                raise AssertionError(f"window block {w}: free list disagrees with its references")
            g = self.owner[w]
            if g >= 0 and self.of_block[g] != w:
                raise AssertionError(f"window block {w}: pairing with main block {g} is one-sided")
        for g, w in enumerate(self.of_block):
            if w >= 0 and self.owner[w] != g:
                raise AssertionError(f"main block {g}: pairing with window block {w} is one-sided")
