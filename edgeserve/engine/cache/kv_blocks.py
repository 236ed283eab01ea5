"""Paged KV bookkeeping: reference-counted blocks, per-sequence block tables and a prefix cache."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Hashable, MutableMapping, Protocol, Sequence

from .prefix_key import NO_KEY, PrefixKey
from .window_blocks import OutOfBlocksError, WindowBlocks

if TYPE_CHECKING:  # the scheduler's request registry: the cache names its type only (cache imports no sched)
    from ..sched.request_state import Registry

SeqId = Hashable

_ROOT_HASH = b""


def block_hash(parent: bytes, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """Prefix-cache key of a full block: chained over its parent's key, its own token ids and `extra` (what else
    decides its tokens' KV: see PrefixKey)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes() + extra).digest()




class BlockOffload(Protocol):
    """Tiers behind the pool (edgeserve.offload.PoolOffload): where evicted cached blocks go and come back from."""

    def offer(self, block_id: int, block_hash: bytes, parent_hash: bytes, token_ids: tuple[int, ...]) -> None:
        """Save a cached block whose slots are about to be reused."""

    def contains(self, block_hash: bytes) -> bool:
        """Whether a tier claims the block."""

    def fetch(self, block_hash: bytes, block_id: int) -> bool:
        """Copy the block into pool block `block_id`; False if it is missing or corrupt."""


@dataclass
class Block:
    """One physical block of `block_size` KV slots."""

    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once the block is full and computed
    parent_hash: bytes = _ROOT_HASH
    # the tokens whose KV the block holds, after the prefix `parent_hash` names: all of them once it is hashed
    # (kept with the hash to rule out collisions), the computed ones so far in a sequence's last block
    token_ids: tuple[int, ...] = ()


@dataclass
class _SeqBlocks:
    """A sequence's block table and how far its prefix-cache chain has been registered."""

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0  # tokens that have a reserved slot
    num_hashed: int = 0  # leading full blocks whose hash is known
    last_hash: bytes = _ROOT_HASH
    key: PrefixKey = NO_KEY
    window_from: int = 0  # logical blocks window_from..window_to-1 hold a window block (sliding-window layers)
    window_to: int = 0


class BlockManager:
    """Hands out physical blocks 0..num_blocks-1 to sequences and reuses computed full blocks by prefix."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 offload: BlockOffload | None = None, registry: Registry | None = None) -> None:
        """`registry`: the shared request states, whose `kv` part holds each sequence's blocks (a sequence must be
        registered before it gets blocks); without it the block manager keeps its own map by id."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks, least recently freed first; hashed ones can still be revived by a prefix hit.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._by_hash: dict[bytes, int] = {}
        self._num_cached_free = 0  # free blocks that hold a prefix (kept as a count: stats read it every step)
        self._seqs: MutableMapping[SeqId, _SeqBlocks] = {} if registry is None else registry.view("kv")
        self.num_prompt_tokens_computed = 0
        self.num_prompt_tokens_reused = 0  # device and tier hits
        self.offload = offload  # evicted cached blocks go there; prefix lookups continue there
        self.num_prompt_tokens_fetched = 0  # the part of the reused tokens copied up from a tier
        self.window: WindowBlocks | None = None  # the sliding-window layers' pool, when the model keeps one
        # Copies one block's KV into another (the KV pool's `copy_block`); with it, a prompt that matches only the
        # first tokens of a block (the same prompt again, a regenerated reply) reuses them from a copy.
        self.copy_block: Callable[[int, int], None] | None = None
        self._children: dict[bytes, dict[int, None]] = {}  # parent hash -> blocks holding KV after that prefix
        # A hybrid model's recurrent states (engine.cache.state_cache): a prefix hit (device blocks, then tier blocks) is
        # cut to the blocks this says it can resume after (given the hit blocks' hashes: how many), no hit ends
        # inside a block, and `on_evict` hears of every hash that leaves the device cache
        self.usable_prefix: Callable[[list[bytes | None]], int] | None = None
        self.on_evict: Callable[[bytes], None] | None = None

    def use_window(self, window: int, num_window_blocks: int) -> WindowBlocks:
        """Keep the sliding-window layers' K/V in a pool of `num_window_blocks` blocks that each sequence holds only
        within its last `window` tokens (call before the first allocation); returns it (the KV pool reads its
        pairing). Offload tiers hold whole blocks of every layer, so they cannot be used with it."""
        if self._seqs:
            raise ValueError("use_window must come before the first allocation")
        if self.offload is not None:
            raise ValueError("KV offload tiers cannot be combined with a sliding-window block pool")
        self.window = WindowBlocks(window, self.block_size, num_window_blocks, self.num_blocks)
        return self.window

    # --- queries ---------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no user (including cached ones that a new request may reclaim)."""
        return len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a reusable prefix."""
        return self._num_cached_free

    def blocks_needed(self, n_tokens: int) -> int:
        """Blocks that hold `n_tokens` tokens."""
        return -(-n_tokens // self.block_size)

    def can_allocate(self, n_tokens: int) -> bool:
        """Whether a new sequence of `n_tokens` fits even with no prefix hit."""
        return self.blocks_needed(n_tokens) <= len(self._free)

    def has_seq(self, seq: SeqId) -> bool:
        return seq in self._seqs

    def block_table(self, seq: SeqId) -> list[int]:
        """Physical block ids of `seq`, in logical order (a copy)."""
        return list(self._seqs[seq].block_ids)

    def block_ids(self, seq: SeqId) -> list[int]:
        """Physical block ids of `seq`, in logical order: the live list (read it, never change it; it changes
        at its tail as the sequence grows or is truncated)."""
        return self._seqs[seq].block_ids

    def slot(self, seq: SeqId, position: int) -> int:
        """KV slot of token `position` of `seq`."""
        table = self._seqs[seq].block_ids
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def slots(self, seq: SeqId, start: int, stop: int) -> list[int]:
        """KV slots of positions start..stop-1 of `seq` (the tokens a step computes). With a window pool, the
        blocks they fall in get their window blocks here (see `use_window`)."""
        state, bs = self._seqs[seq], self.block_size
        table = state.block_ids
        if self.window is not None and stop > start:
            last = (stop - 1) // bs + 1
            for i in range(state.window_to, last):
                self.window.acquire(table[i])
            state.window_to = max(state.window_to, last)
        return [table[p // bs] * bs + p % bs for p in range(start, stop)]

    def prefix_hash(self, seq: SeqId, num_blocks: int) -> bytes | None:
        """The prefix-cache key of `seq`'s first `num_blocks` blocks, when they are all hashed (else None)."""
        state = self._seqs[seq]
        return state.last_hash if num_blocks and state.num_hashed == num_blocks else None

    def window_blocks_held(self, seq: SeqId) -> int:
        """How many window blocks `seq` holds (0 without a window pool)."""
        state = self._seqs[seq]
        return state.window_to - state.window_from

    # --- allocation ------------------------------------------------------

    def allocate(self, seq: SeqId, token_ids: Sequence[int], key: PrefixKey = NO_KEY) -> int:
        """Give `seq` blocks for `token_ids`, reusing cached prefix blocks; return how many tokens are cached.
        `key`: what else enters its blocks' hashes (PrefixKey).

        The last token is never reported cached: the model must compute it to sample.
        """
        if seq in self._seqs:
            raise ValueError(f"sequence {seq!r} already has blocks")
        n = len(token_ids)
        if n == 0:
            raise ValueError("cannot allocate an empty sequence")
        hits, tier_hits, parent, window_from = self._lookup(token_ids, key)
        fresh = self.blocks_needed(n) - len(hits)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        if fresh + revived > len(self._free):
            raise OutOfBlocksError(f"need {fresh + revived} free blocks, have {len(self._free)}")
        for b in hits:
            self._ref(b)
        new_ids, parent = self._fetch(tier_hits, parent)
        fetched = len(new_ids)
        if fetched < len(tier_hits) and self.usable_prefix is not None:
            # a hybrid's snapshot is after the last tier hit, which did not come back: look again from what did
            for b in hits + new_ids:
                self._unref(b)
            return self.allocate(seq, token_ids, key)
        start = (len(hits) + fetched) * self.block_size
        source, partial = (self._find_partial(parent, token_ids[start:n - 1])
                           if self.enable_prefix_caching and not key.block_extra(start // self.block_size,
                                                                                   self.block_size)
                           else (None, 0))
        if source is not None and self.blocks[source].ref_count == 0 and self.blocks[source].hash is None:
            self._claim(source)  # a finished sequence's last block: taken over as it is, no copy
            new_ids.append(source)
            source = None
        elif source is not None and self.blocks[source].ref_count == 0 and fresh - fetched + 1 > len(self._free):
            source, partial = None, 0  # pinning it would leave too few free blocks
        if source is not None:
            self._ref(source)  # so the fresh blocks cannot evict it before it is copied
        new_ids += [self._take_free() for _ in range(fresh - len(new_ids))]
        if source is not None:
            self.copy_block(source, new_ids[fetched])
            self._unref(source)
        state = _SeqBlocks(block_ids=hits + new_ids, num_tokens=n, num_hashed=len(hits) + fetched, last_hash=parent,
                           key=key)
        if self.window is not None:
            for b in hits[window_from:]:
                self.window.acquire(b)
            state.window_from, state.window_to = window_from, len(hits)
        self._seqs[seq] = state
        cached = start + partial
        self.num_prompt_tokens_fetched += fetched * self.block_size
        self.num_prompt_tokens_reused += cached
        self.num_prompt_tokens_computed += n - cached
        return cached

    def _lookup(self, token_ids: Sequence[int], key: PrefixKey) -> tuple[list[int], list, bytes, int]:
        """A new sequence's prefix hit: the device blocks, then the blocks in the tiers that continue them (hash,
        parent hash, tokens), the key of the last device block, and the first logical block that needs a window
        block."""
        max_blocks = (len(token_ids) - 1) // self.block_size if self.enable_prefix_caching else 0
        hits, parent = self._find_prefix(token_ids, max_blocks, key)
        tier_hits = self._find_in_tiers(token_ids, len(hits), max_blocks, parent, key)
        if self.usable_prefix is not None and (hits or tier_hits):
            # a hybrid resumes only where a state snapshot was kept (on the device or in a tier)
            usable = self.usable_prefix([self.blocks[b].hash for b in hits] + [h for h, _, _ in tier_hits])
            hits, tier_hits = hits[:usable], tier_hits[:max(0, usable - len(hits))]
            parent = self.blocks[hits[-1]].hash if hits else key.root
        window_from = 0
        if self.window is not None:  # (no tiers with a window pool)
            hits, window_from = self._window_covered(hits)
            parent = self.blocks[hits[-1]].hash if hits else key.root
        return hits, tier_hits, parent, window_from

    def allocate_uncached(self, seq: SeqId, num_tokens: int, key: PrefixKey = NO_KEY) -> list[int]:
        """Give `seq` fresh blocks for `num_tokens` tokens with no prefix lookup (their KV is about to be swapped in);
        return its block table. Call `commit_full_blocks` once the KV is back."""
        if seq in self._seqs:
            raise ValueError(f"sequence {seq!r} already has blocks")
        if self.window is not None:
            raise ValueError("swapped KV cannot come back into a sliding-window block pool")
        needed = self.blocks_needed(num_tokens)
        if needed > len(self._free):
            raise OutOfBlocksError(f"need {needed} free blocks, have {len(self._free)}")
        self._seqs[seq] = _SeqBlocks(block_ids=[self._take_free() for _ in range(needed)], num_tokens=num_tokens,
                                     last_hash=key.root, key=key)
        return self.block_table(seq)

    def ensure_capacity(self, seq: SeqId, new_total_tokens: int) -> bool:
        """Reserve slots so `seq` holds `new_total_tokens` tokens; False (and no change) if blocks run out."""
        state = self._seqs[seq]
        extra = self.blocks_needed(new_total_tokens) - len(state.block_ids)
        if extra > len(self._free):
            return False
        state.block_ids.extend(self._take_free() for _ in range(extra))
        state.num_tokens = max(state.num_tokens, new_total_tokens)
        return True

    def append_slot(self, seq: SeqId) -> bool:
        """Reserve a slot for one more token of `seq`; False if blocks run out."""
        return self.ensure_capacity(seq, self._seqs[seq].num_tokens + 1)

    def truncate(self, seq: SeqId, num_tokens: int) -> None:
        """Shrink `seq`'s reservation to its first `num_tokens` tokens, returning the blocks past them (rollback
        of rejected speculative tokens). Only unhashed tail blocks can go: hashed ones hold computed tokens."""
        state = self._seqs[seq]
        keep = self.blocks_needed(num_tokens)
        if keep < state.num_hashed:
            raise ValueError(f"cannot truncate {seq!r} into its {state.num_hashed} prefix-cached blocks")
        while len(state.block_ids) > keep:
            b = state.block_ids.pop()
            block = self.blocks[b]
            if self.window is not None and len(state.block_ids) < state.window_to:
                self.window.release(b, cached=False)
                state.window_to = len(state.block_ids)
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[b] = None
                self._free.move_to_end(b, last=False)  # nothing cached in it: hand it out first
                self._num_cached_free += block.hash is not None
        state.num_tokens = min(state.num_tokens, num_tokens)

    def commit_full_blocks(self, seq: SeqId, token_ids: Sequence[int], num_computed: int) -> None:
        """Register the prefix-cache keys of `seq`'s blocks that are full within its first `num_computed` tokens."""
        if not self.enable_prefix_caching:
            if self.window is not None:
                self._release_behind_window(seq, num_computed)
            return
        state, bs = self._seqs[seq], self.block_size
        num_full = min(num_computed, len(token_ids)) // bs
        for i in range(state.num_hashed, num_full):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = block_hash(state.last_hash, tokens, state.key.block_extra(i, bs))
            block = self.blocks[state.block_ids[i]]
            # Another sequence may have computed the same block first: keep that one as the cached copy.
            if h not in self._by_hash:
                self._set_content(block, state.last_hash, tokens)
                block.hash = h
                self._by_hash[h] = block.block_id
            elif block.hash is None:
                self._forget_content(block)  # a duplicate of the cached copy: nothing to find it by
            state.last_hash = h
        state.num_hashed = max(state.num_hashed, num_full)
        tail = min(num_computed, len(token_ids)) - num_full * bs
        if (tail > 0 and self.copy_block is not None and self.window is None and num_full == state.num_hashed
                and not state.key.block_extra(num_full, bs)):
            block = self.blocks[state.block_ids[num_full]]
            if block.hash is None:
                self._set_content(block, state.last_hash, tuple(token_ids[num_full * bs:num_full * bs + tail]))
        if self.window is not None:
            self._release_behind_window(seq, num_computed)

    def free(self, seq: SeqId) -> None:
        """Release `seq`'s blocks; computed full blocks stay cached until their space is needed."""
        state = self._seqs.pop(seq)
        if self.window is not None:
            for b in reversed(state.block_ids[state.window_from:state.window_to]):
                self.window.release(b, cached=self.blocks[b].hash is not None)
        # Tail blocks first, so a shared prefix outlives the suffixes that hang off it.
        for b in reversed(state.block_ids):
            block = self.blocks[b]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[b] = None
                if block.hash is not None:
                    self._num_cached_free += 1
                elif not block.token_ids:  # nothing to reuse: hand it out before cached blocks
                    self._free.move_to_end(b, last=False)

    def offer_cached(self) -> int:
        """Offer every block that holds a cached prefix to the offload tiers (at shutdown); return how many."""
        if self.offload is None:
            return 0
        for h, b in self._by_hash.items():
            block = self.blocks[b]
            self.offload.offer(b, h, block.parent_hash, block.token_ids)
        return len(self._by_hash)

    # --- internals -------------------------------------------------------

    def _window_covered(self, hits: list[int]) -> tuple[list[int], int]:
        """The longest leading part of prefix hit `hits` whose last `window` tokens still have their window blocks,
        and the first of its logical blocks the new sequence needs a window block for."""
        window = self.window
        n = len(hits)
        while n > 0:
            first = window.first_needed(n * self.block_size)
            missing = [i for i in range(first, n) if not window.has(hits[i])]
            if not missing:
                return hits[:n], first
            n = missing[-1]  # longer hits all need the missing block; the first shorter one that may not ends there
        return [], 0

    def _release_behind_window(self, seq: SeqId, num_computed: int) -> None:
        """Give back the window blocks of `seq` that its next query can no longer see."""
        state = self._seqs[seq]
        stop = min(self.window.first_needed(num_computed), state.window_to)
        for i in range(state.window_from, stop):
            b = state.block_ids[i]
            self.window.release(b, cached=self.blocks[b].hash is not None)
        state.window_from = max(state.window_from, stop)

    def _find_prefix(self, token_ids: Sequence[int], max_blocks: int,
                     key: PrefixKey = NO_KEY) -> tuple[list[int], bytes]:
        """Cached blocks that match the first blocks of `token_ids` (under `key`), and the key of the last one."""
        bs, parent, hits = self.block_size, key.root, []
        for i in range(max_blocks):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = block_hash(parent, tokens, key.block_extra(i, bs))
            b = self._by_hash.get(h)
            if b is None:
                break
            block = self.blocks[b]
            if block.token_ids != tokens or block.parent_hash != parent:
                break
            hits.append(b)
            parent = h
        return hits, parent

    def _find_in_tiers(self, token_ids: Sequence[int], start: int, max_blocks: int, parent: bytes,
                       key: PrefixKey = NO_KEY) -> list[tuple[bytes, bytes, tuple[int, ...]]]:
        """Blocks start.. of `token_ids` that the offload tiers claim, in order: (hash, parent hash, tokens)."""
        if self.offload is None:
            return []
        bs, found = self.block_size, []
        for i in range(start, max_blocks):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = block_hash(parent, tokens, key.block_extra(i, bs))
            if h in self._by_hash or not self.offload.contains(h):
                break  # still on the device (kept simple: recomputed) or nowhere
            found.append((h, parent, tokens))
            parent = h
        return found

    def _fetch(self, tier_hits: list[tuple[bytes, bytes, tuple[int, ...]]], parent: bytes) -> tuple[list[int], bytes]:
        """Copy tier hits, in order, into fresh blocks until one fails; register them as cached.

        One block is taken and filled at a time, so the blocks it evicts cannot push the next hit out of the
        host tier before it is read. Returns the filled blocks and the key of the last one.
        """
        filled: list[int] = []
        for h, p, tokens in tier_hits:
            b = self._take_free()
            if not self.offload.fetch(h, b):
                self._release_fresh(b)
                break
            block = self.blocks[b]
            self._set_content(block, p, tokens)
            block.hash = h
            self._by_hash[h] = b
            filled.append(b)
            parent = h
        return filled, parent

    def _find_partial(self, parent: bytes, wanted: Sequence[int]) -> tuple[int | None, int]:
        """The block holding the longest run of `wanted`'s first tokens after prefix `parent`, and that length
        (None, 0 when nothing matches or blocks cannot be copied)."""
        if self.copy_block is None or self.window is not None or self.usable_prefix is not None or not wanted:
            return None, 0
        best, best_len = None, 0
        for b in self._children.get(parent, ()):
            have = self.blocks[b].token_ids
            k, limit = 0, min(len(have), len(wanted))
            while k < limit and have[k] == wanted[k]:
                k += 1
            if k > best_len:
                best, best_len = b, k
        return best, best_len

    def _set_content(self, block: Block, parent: bytes, token_ids: tuple[int, ...]) -> None:
        """Record that `block` holds the KV of `token_ids` after prefix `parent` (findable by `_find_partial`)."""
        if block.token_ids and block.parent_hash != parent:
            self._forget_content(block)
        block.parent_hash, block.token_ids = parent, token_ids
        self._children.setdefault(parent, {})[block.block_id] = None

    def _forget_content(self, block: Block) -> None:
        children = self._children.get(block.parent_hash)
        if children is not None:
            children.pop(block.block_id, None)
            if not children:
                del self._children[block.parent_hash]
        block.parent_hash, block.token_ids = _ROOT_HASH, ()

    def _claim(self, b: int) -> None:
        """Take free unhashed block `b` out of the free list for a new owner, KV and all."""
        del self._free[b]
        self._forget_content(self.blocks[b])
        self.blocks[b].ref_count = 1

    def _unref(self, b: int) -> None:
        """Drop one reference to block `b`; at none it is free (last in line: it holds reusable KV)."""
        block = self.blocks[b]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[b] = None
            self._num_cached_free += block.hash is not None

    def _release_fresh(self, b: int) -> None:
        """Give back a block just taken with `_take_free` (first in line again)."""
        self.blocks[b].ref_count = 0
        self._free[b] = None
        self._free.move_to_end(b, last=False)

    def _ref(self, b: int) -> None:
        block = self.blocks[b]
        if block.ref_count == 0:
            del self._free[b]
            self._num_cached_free -= block.hash is not None
        block.ref_count += 1

    def _take_free(self) -> int:
        """Pop the least recently freed block, dropping any prefix it cached."""
        b, _ = self._free.popitem(last=False)
        block = self.blocks[b]
        if self.window is not None:
            self.window.drop(b)
        if block.hash is not None:
            self._num_cached_free -= 1
            if self._by_hash.get(block.hash) == b:
                del self._by_hash[block.hash]
                if self.offload is not None:  # moved down a tier instead of dropped
                    self.offload.offer(b, block.hash, block.parent_hash, block.token_ids)
                if self.on_evict is not None:
                    self.on_evict(block.hash)
            block.hash = None
        self._forget_content(block)
        block.ref_count = 1
        return b

    def check_integrity(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent (for tests)."""
        refs = [0] * self.num_blocks
        for seq, state in self._seqs.items():
            if len(state.block_ids) != self.blocks_needed(state.num_tokens):
                raise AssertionError(f"{seq!r}: {len(state.block_ids)} blocks for {state.num_tokens} tokens")
            for b in state.block_ids:
                refs[b] += 1
        free = cached = used = 0
        for block in self.blocks:
            if block.ref_count != refs[block.block_id]:
                raise AssertionError(f"block {block.block_id}: ref_count {block.ref_count} != {refs[block.block_id]}")
            if (block.ref_count == 0) != (block.block_id in self._free):
                raise AssertionError(f"block {block.block_id}: free list disagrees with ref_count")
            if block.hash is not None and self._by_hash.get(block.hash) != block.block_id:
                raise AssertionError(f"block {block.block_id}: hashed but not in the hash table")
            if block.ref_count > 0:
                used += 1
            elif block.hash is not None:
                cached += 1
            else:
                free += 1
        if free + cached + used != self.num_blocks or free + cached != len(self._free):
            raise AssertionError(f"free {free} + cached {cached} + used {used} != {self.num_blocks}")
        if cached != self._num_cached_free:
            raise AssertionError(f"cached free blocks: counted {cached}, kept {self._num_cached_free}")
        for h, b in self._by_hash.items():
            if self.blocks[b].hash != h:
                raise AssertionError(f"hash table entry for block {b} is stale")
        for parent, children in self._children.items():
            for b in children:
                if self.blocks[b].parent_hash != parent or not self.blocks[b].token_ids:
                    raise AssertionError(f"block {b} is listed after a prefix it does not hold")
        for block in self.blocks:
            if block.token_ids and block.block_id not in self._children.get(block.parent_hash, ()):
                raise AssertionError(f"block {block.block_id} holds tokens but cannot be found")
        if self.window is not None:
            held = []
            for seq, state in self._seqs.items():
                if not 0 <= state.window_from <= state.window_to <= len(state.block_ids):
                    raise AssertionError(f"{seq!r}: window holds {state.window_from}..{state.window_to} out of range")
                held += state.block_ids[state.window_from:state.window_to]
            self.window.check(held)
