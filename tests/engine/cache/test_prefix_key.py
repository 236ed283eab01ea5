"""PrefixKey: a chain root (adapters) and digest spans (images) enter the block hashes, so that different adapters
or images never share KV while the same ones hit the cache."""

from edgeserve.engine.cache.kv_blocks import BlockManager
from edgeserve.engine.cache.prefix_key import NO_KEY, PrefixKey

BS = 4
PROMPT = list(range(100, 113))  # 3 full blocks + 1


def _cached_after(first: PrefixKey, second: PrefixKey, prompt=PROMPT) -> int:
    bm = BlockManager(32, BS)
    bm.allocate("a", prompt, first)
    bm.commit_full_blocks("a", prompt, len(prompt))
    bm.free("a")
    cached = bm.allocate("b", prompt, second)
    bm.check_integrity()
    return cached


def test_the_same_key_hits_and_another_root_never_does():
    a, b = PrefixKey(root=b"adapter-a"), PrefixKey(root=b"adapter-b")
    assert _cached_after(a, a) == 12
    assert _cached_after(a, b) == 0
    assert _cached_after(a, NO_KEY) == 0
    assert _cached_after(NO_KEY, NO_KEY) == 12


def test_a_span_changes_the_blocks_it_touches_and_those_after():
    img1 = PrefixKey(spans=((5, 7, b"image-1"),))  # inside block 1
    img2 = PrefixKey(spans=((5, 7, b"image-2"),))
    assert _cached_after(img1, img1) == 12
    assert _cached_after(img1, img2) == 4  # block 0 precedes the image: shared; 1 and 2 are not
    assert _cached_after(img1, NO_KEY) == 4


def test_block_extra_covers_every_block_a_span_overlaps():
    key = PrefixKey(spans=((3, 9, b"x"), (9, 10, b"y")))
    assert [key.block_extra(i, BS) for i in range(4)] == [b"x", b"x", b"xy", b""]


def test_swapped_in_blocks_keep_the_key():
    bm = BlockManager(32, BS)
    key = PrefixKey(root=b"r")
    bm.allocate_uncached("a", len(PROMPT), key)
    bm.commit_full_blocks("a", PROMPT, len(PROMPT))
    bm.free("a")
    assert bm.allocate("b", PROMPT, key) == 12
    bm.free("b")
    assert bm.allocate("c", PROMPT) == 0
