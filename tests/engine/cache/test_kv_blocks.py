"""BlockManager: allocation, prefix reuse, LRU eviction of cached blocks, integrity under random workloads."""

import random

import pytest

from edgeserve.engine.cache.kv_blocks import BlockManager, OutOfBlocksError

BS = 4


def computed(bm: BlockManager, seq, tokens):
    """Pretend the model computed every token of `seq` (registers its full blocks)."""
    bm.commit_full_blocks(seq, tokens, len(tokens))


def test_fresh_allocation_and_slots():
    bm = BlockManager(8, BS)
    assert bm.allocate("a", list(range(10))) == 0
    table = bm.block_table("a")
    assert len(table) == 3 and bm.num_free_blocks == 5
    assert bm.slot("a", 0) == table[0] * BS
    assert bm.slot("a", 9) == table[2] * BS + 1
    assert bm.slots("a", 3, 6) == [bm.slot("a", p) for p in range(3, 6)]
    bm.check_integrity()


def test_prefix_hit_reuses_blocks_and_reports_cached_tokens():
    bm = BlockManager(16, BS)
    prompt = list(range(100, 111))  # 11 tokens: 2 full blocks + 3
    bm.allocate("a", prompt)
    computed(bm, "a", prompt)
    first_two = bm.block_table("a")[:2]
    bm.free("a")
    assert bm.allocate("b", prompt + [7, 8]) == 8
    assert bm.block_table("b")[:2] == first_two
    assert bm.num_prompt_tokens_reused == 8
    assert bm.num_prompt_tokens_computed == 11 + 5
    bm.check_integrity()


def test_whole_prompt_never_reported_cached():
    bm = BlockManager(16, BS)
    prompt = list(range(8))  # exactly two full blocks
    bm.allocate("a", prompt)
    computed(bm, "a", prompt)
    bm.free("a")
    # The last token must be recomputed, so only the first block counts as cached.
    assert bm.allocate("b", prompt) == 4
    bm.check_integrity()


def test_live_sequences_share_prefix_blocks():
    bm = BlockManager(16, BS)
    system = list(range(8))
    bm.allocate("a", system + [50, 51])
    computed(bm, "a", system + [50, 51])
    assert bm.allocate("b", system + [60, 61, 62]) == 8
    ta, tb = bm.block_table("a"), bm.block_table("b")
    assert ta[:2] == tb[:2] and ta[2] != tb[2]
    assert [bm.blocks[b].ref_count for b in ta[:2]] == [2, 2]
    bm.free("a")
    assert [bm.blocks[b].ref_count for b in ta[:2]] == [1, 1]
    bm.check_integrity()
    bm.free("b")
    assert bm.num_free_blocks == 16
    bm.check_integrity()


def test_different_prefix_does_not_hit():
    bm = BlockManager(16, BS)
    bm.allocate("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    computed(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # Same second block, different first block: the chained key must not match.
    assert bm.allocate("b", [0, 2, 3, 4, 5, 6, 7, 8, 9]) == 0


def test_same_block_at_another_position_does_not_hit():
    """A block's key chains its parent's: the same tokens cached at one position are no hit at another (their KV
    was computed at other positions and after other tokens)."""
    bm = BlockManager(16, BS)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    bm.allocate("first", a + b + [9])
    computed(bm, "first", a + b + [9])
    assert bm.allocate("b_first", b + a + [9]) == 0  # b was cached at position 1 only
    assert bm.allocate("a_twice", a + a + b + [9]) == 4  # the second a sits after a, not at the start
    computed(bm, "a_twice", a + a + b + [9])  # now a is cached at positions 0 and 1, b at 1 and 2
    assert bm.allocate("again", a + b + [10]) == 8  # each prefix hits in full: one key per (position, prefix)
    assert bm.allocate("twice_again", a + a + b + [10]) == 12
    assert bm.allocate("b_again", b + [10]) == 0
    bm.check_integrity()


def test_uncomputed_blocks_are_not_cached():
    bm = BlockManager(16, BS)
    prompt = list(range(12))
    bm.allocate("a", prompt)
    bm.commit_full_blocks("a", prompt, 5)  # only the first block is computed so far
    assert bm.allocate("b", prompt) == 4


def test_freed_cached_blocks_reused_then_evicted_lru_first():
    bm = BlockManager(6, BS)
    old, new = [1] * 8 + [9], [2] * 8 + [9]
    for seq, prompt in (("old", old), ("new", new)):
        bm.allocate(seq, prompt)
        computed(bm, seq, prompt)
        bm.free(seq)
    assert bm.num_free_blocks == 6 and bm.num_cached_free_blocks == 4
    # A later identical request revives the cached blocks.
    assert bm.allocate("again", old) == 8
    bm.free("again")
    # "new" is now the least recently used prefix: it is evicted before "old".
    bm.allocate("big", list(range(100, 112)))  # 3 blocks: the 2 uncached ones, then the LRU cached one
    assert bm.num_cached_free_blocks == 3
    bm.free("big")
    assert bm.allocate("old2", old) == 8
    assert bm.allocate("new2", new) == 4  # its first block survived, the second was evicted
    bm.check_integrity()


def test_out_of_blocks_and_growth():
    bm = BlockManager(3, BS)
    assert bm.can_allocate(12) and not bm.can_allocate(13)
    bm.allocate("a", list(range(8)))
    with pytest.raises(OutOfBlocksError):
        bm.allocate("b", list(range(100, 109)))
    bm.check_integrity()
    assert bm.ensure_capacity("a", 9)
    assert not bm.ensure_capacity("a", 13)
    for _ in range(3):
        assert bm.append_slot("a")
    assert not bm.append_slot("a")  # 12 tokens fill all 3 blocks
    assert len(bm.block_table("a")) == 3
    bm.check_integrity()


class SlotContents:
    """A stand-in KV pool, with the pool's `copy_block`, that records which prefix each slot's KV was computed
    from (a slot at position p holds tokens[:p + 1]: right token, wrong history is caught too)."""

    def __init__(self, bm: BlockManager) -> None:
        self.slots = [None] * (bm.num_blocks * bm.block_size)
        self.copies: list[tuple[int, int]] = []
        self.bm = bm
        bm.copy_block = self.copy_block

    def copy_block(self, src: int, dst: int) -> None:
        bs = self.bm.block_size
        self.slots[dst * bs:(dst + 1) * bs] = self.slots[src * bs:(src + 1) * bs]
        self.copies.append((src, dst))

    def compute(self, seq, tokens, start: int, stop: int, commit: bool = True) -> None:
        """Write tokens start..stop-1 of `seq` into their slots and register them as computed (not drafts: the
        scheduler commits only the accepted tokens, after the rollback)."""
        for p in range(start, stop):
            self.slots[self.bm.slot(seq, p)] = tuple(tokens[:p + 1])
        if commit:
            self.bm.commit_full_blocks(seq, tokens, stop)

    def holds(self, seq, tokens, stop: int) -> bool:
        return all(self.slots[self.bm.slot(seq, p)] == tuple(tokens[:p + 1]) for p in range(stop))


def computed_seq(tokens, num_blocks: int = 16) -> tuple[BlockManager, SlotContents]:
    """A block manager with a slot-recording pool where sequence "a" holds `tokens`, all computed."""
    bm = BlockManager(num_blocks, BS)
    kv = SlotContents(bm)
    bm.allocate("a", tokens)
    kv.compute("a", tokens, 0, len(tokens))
    return bm, kv


def test_same_prompt_again_reuses_the_partial_last_block():
    prompt = list(range(100, 111))  # 2 full blocks + 3 tokens
    bm, kv = computed_seq(prompt)
    reply = prompt + [7, 8]  # one more token computed by decoding, the last sampled one never is
    bm.append_slot("a")
    kv.compute("a", reply, 11, 12)
    bm.free("a")
    # everything but the last token comes back: 8 from whole blocks, 2 from a copy of the third block
    assert bm.allocate("b", prompt) == 10
    assert kv.copies and kv.holds("b", prompt, 10)
    assert bm.num_prompt_tokens_computed == 11 + 1
    bm.check_integrity()


def test_partly_matching_cached_block_is_copied_not_taken():
    long = list(range(200, 213))  # 3 full blocks + 1
    bm, kv = computed_seq(long)
    third = bm.block_table("a")[2]
    bm.free("a")
    shorter = long[:10] + [999]  # diverges inside the third block, after 2 of its tokens
    assert bm.allocate("b", shorter) == 10
    assert kv.holds("b", shorter, 10)
    assert bm.block_table("b")[2] != third  # the cached full block stays cached for the longer prompt
    bm.free("b")
    assert bm.allocate("c", long) == 12
    assert bm.block_table("c")[2] == third
    bm.check_integrity()


def test_no_partial_reuse_without_a_block_copy_or_prefix_caching():
    for bm in (BlockManager(16, BS), BlockManager(16, BS, enable_prefix_caching=False)):
        if not bm.enable_prefix_caching:
            SlotContents(bm)
        prompt = list(range(100, 111))
        bm.allocate("a", prompt)
        bm.commit_full_blocks("a", prompt, 11)
        bm.free("a")
        assert bm.allocate("b", prompt) == (8 if bm.enable_prefix_caching else 0)


def test_rolled_back_tokens_are_not_reused():
    prompt = list(range(100, 106))  # 1 full block + 2
    bm, kv = computed_seq(prompt)
    drafted = prompt + [1, 2, 3, 4]  # four speculative tokens computed into a new block, then rejected
    bm.ensure_capacity("a", len(drafted))
    kv.compute("a", drafted, 6, 10, commit=False)
    bm.truncate("a", 6)
    bm.commit_full_blocks("a", prompt, 6)
    bm.free("a")
    assert bm.allocate("b", prompt + [1, 2, 3, 5]) == 6  # the block past the rollback is not offered
    bm.check_integrity()


def test_partial_reuse_never_exhausts_the_pool():
    prompt = list(range(100, 106))  # 2 blocks
    bm, kv = computed_seq(prompt, num_blocks=4)
    bm.free("a")
    bm.allocate("x", list(range(8)))  # holds 2 of the 4 blocks; the 2 free ones are a's
    assert bm.allocate("b", prompt) == 5  # a's first block comes back whole, its second one is taken over
    assert not kv.copies and kv.holds("b", prompt, 5)
    bm.check_integrity()


@pytest.mark.parametrize("partial", [False, True])
def test_integrity_and_kv_under_random_workload(partial):
    """Prompt chunks, decode steps, rolled-back drafts and frees at random: the bookkeeping stays consistent and
    every token reported cached really has its KV in its slot (whole blocks only, or partial blocks too)."""
    rng = random.Random(4321)
    bm = BlockManager(40, BS)
    kv = SlotContents(bm)
    if not partial:
        bm.copy_block = None
    prefixes = [[rng.randrange(4) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    live: dict[int, list] = {}  # seq -> [all token ids, computed]
    next_id = 0
    for _ in range(1500):
        op = rng.random()
        if op < 0.3:
            tokens = rng.choice(prefixes) + [rng.randrange(4) for _ in range(rng.randrange(1, 10))]
            if bm.can_allocate(len(tokens)):
                cached = bm.allocate(next_id, tokens)
                assert cached < len(tokens) and (partial or cached % BS == 0)
                assert kv.holds(next_id, tokens, cached)  # every token reported cached really is in its slot
                live[next_id] = [tokens, cached]
                next_id += 1
        elif op < 0.85 and live:
            seq = rng.choice(list(live))
            tokens, done = live[seq]
            if done == len(tokens):  # a decode step: the sampled token is appended, then computed
                if not bm.append_slot(seq):
                    continue
                tokens.append(rng.randrange(4))
            stop = rng.randint(done + 1, len(tokens))  # a prompt chunk, or the one decode token
            kv.compute(seq, tokens, done, stop)  # the whole token list, as the scheduler passes it
            if stop == len(tokens) and rng.random() < 0.3 and bm.ensure_capacity(seq, stop + 3):
                drafted = tokens + [rng.randrange(4) for _ in range(3)]  # drafts computed, then rolled back
                kv.compute(seq, drafted, stop, stop + 3, commit=False)
                bm.truncate(seq, stop)
                bm.commit_full_blocks(seq, tokens, stop)
            live[seq][1] = stop
        elif live:
            seq = rng.choice(list(live))
            bm.free(seq)
            del live[seq]
        bm.check_integrity()
    assert bm.num_prompt_tokens_reused > 0
    assert (len(kv.copies) > 5 and bm.num_prompt_tokens_reused % BS != 0) if partial else not kv.copies
    for seq in list(live):
        bm.free(seq)
    bm.check_integrity()
    assert bm.num_free_blocks == 40
