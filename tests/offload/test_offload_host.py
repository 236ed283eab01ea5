"""HostTier: LRU under a byte budget, copies that own their memory, swap entries that are never evicted."""

import torch

from edgeserve.offload import HostBlock, HostTier
from edgeserve.offload.host_tier import host_copy

from offload_helpers import LAYOUT, make_chain


def _block(entry) -> HostBlock:
    h, p, t, k, v = entry
    return HostBlock(h, p, t, host_copy(k, False), host_copy(v, False))


def test_lru_evicts_least_recently_used_and_stays_in_budget():
    chain = make_chain(5)
    tier = HostTier(3 * LAYOUT.block_nbytes, pin_memory=False)
    for e in chain[:3]:
        assert tier.put(_block(e)) == []
    tier.get(chain[0][0])  # touch: chain[1] is now the oldest
    evicted = tier.put(_block(chain[3]))
    assert [b.block_hash for b in evicted] == [chain[1][0]]
    evicted = tier.put(_block(chain[4]))
    assert [b.block_hash for b in evicted] == [chain[2][0]]
    assert tier.num_blocks == 3 and tier.used_bytes == 3 * LAYOUT.block_nbytes <= tier.capacity_bytes
    assert chain[0][0] in tier and chain[1][0] not in tier


def test_put_existing_is_a_touch_and_too_big_is_refused():
    chain = make_chain(2)
    tier = HostTier(LAYOUT.block_nbytes // 2, pin_memory=False)
    assert tier.put(_block(chain[0])) is None and tier.num_blocks == 0
    tier = HostTier(2 * LAYOUT.block_nbytes, pin_memory=False)
    tier.put(_block(chain[0]))
    assert tier.put(_block(chain[0])) == [] and tier.used_bytes == LAYOUT.block_nbytes


def test_host_copy_owns_its_memory():
    src = torch.randn(LAYOUT.shape).to(torch.bfloat16)
    copy = host_copy(src, pin=False)
    expected = src.clone()
    src.zero_()  # the pool slot is overwritten after eviction
    assert torch.equal(copy, expected)


def test_swap_evicts_cached_blocks_but_is_never_evicted_itself():
    chain = make_chain(4)
    tier = HostTier(4 * LAYOUT.block_nbytes, pin_memory=False)
    for e in chain:
        tier.put(_block(e))
    k = torch.randn(3, 2, 4, 2, 8).to(torch.bfloat16)  # K and V of two blocks: 2 blocks of bytes together
    v = torch.randn(3, 2, 4, 2, 8).to(torch.bfloat16)
    evicted = tier.put_swap("s1", k, v)
    assert len(evicted) == 2 and tier.num_blocks == 2 and tier.has_swap("s1")
    # Another swap of the same size fits only by evicting the remaining cached blocks.
    assert len(tier.put_swap("s2", k, v)) == 2 and tier.num_blocks == 0
    # Now swaps fill the tier: a third one and even a single cached block are refused.
    assert tier.put_swap("s3", k, v) is None
    assert tier.put(_block(chain[0])) is None
    assert tier.used_bytes == tier.capacity_bytes
    k1, v1 = tier.pop_swap("s1")
    assert torch.equal(k1, k) and torch.equal(v1, v) and not tier.has_swap("s1")
    assert tier.used_bytes == tier.capacity_bytes // 2
    assert tier.pop_swap("s1") is None
