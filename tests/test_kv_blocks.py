"""BlockManager: allocation, prefix reuse, LRU eviction of cached blocks, integrity under random workloads."""

import random

import pytest

from edgeserve.engine.kv_blocks import BlockManager, OutOfBlocksError

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


def test_integrity_under_random_workload():
    rng = random.Random(1234)
    bm = BlockManager(40, BS)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    live: dict[int, list[int]] = {}
    next_id = 0
    for _ in range(600):
        op = rng.random()
        if op < 0.4:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
            if bm.can_allocate(len(tokens)):
                cached = bm.allocate(next_id, tokens)
                assert cached % BS == 0 and cached < len(tokens)
                # Cached blocks really hold this prompt's tokens.
                for i in range(cached // BS):
                    assert bm.blocks[bm.block_table(next_id)[i]].token_ids == tuple(tokens[i * BS:(i + 1) * BS])
                live[next_id] = tokens
                next_id += 1
        elif op < 0.75 and live:
            seq = rng.choice(list(live))
            if bm.append_slot(seq):
                live[seq].append(rng.randrange(50))
                bm.commit_full_blocks(seq, live[seq], len(live[seq]) - rng.randrange(2))
        elif live:
            seq = rng.choice(list(live))
            bm.commit_full_blocks(seq, live[seq], len(live[seq]))
            bm.free(seq)
            del live[seq]
        bm.check_integrity()
    for seq in list(live):
        bm.free(seq)
    bm.check_integrity()
    assert bm.num_free_blocks == 40
    assert bm.num_prompt_tokens_reused > 0
