"""Hybrid models' state snapshots in the KV tiers (issue 51), without a model: a snapshot goes down host -> disk and
comes back bit for bit under its block's hash, shares the host budget and LRU with blocks, survives a restart, and
a damaged, foreign or missing state file is a miss (never wrong bytes); the layout key includes the state format;
swap space carries a state."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from edgeserve.engine.cache.state_pool import StatePool, StateSpec, mamba2_kind
from edgeserve.kernels.torch.gated_delta import DeltaNetDims
from edgeserve.offload import TierManager
from edgeserve.offload.disk_tier import STATE_SUFFIX
from edgeserve.offload.pool_bridge import PoolOffload

from offload_helpers import LAYOUT, make_chain

BIG = 1 << 30
SPEC = StateSpec(2, DeltaNetDims(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6, conv_kernel=4))
HYBRID = dataclasses.replace(LAYOUT, state_format=SPEC.format, state_nbytes=SPEC.bytes_per_sequence)


def pool_with_states(n: int = 4, seed: int = 0) -> StatePool:
    pool = StatePool(SPEC, n)
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        pool.allocate()
    for t in pool.tensors.values():
        t.copy_(torch.randn(t.shape, generator=g))
    return pool


def bridge(tm: TierManager, pool: StatePool) -> PoolOffload:
    k = torch.zeros(LAYOUT.num_layers, 4, *LAYOUT.shape[1:], dtype=LAYOUT.dtype)
    return PoolOffload(tm, k, k.clone(), pool)


def test_the_layout_key_includes_the_state_format():
    assert HYBRID.key != LAYOUT.key
    assert dataclasses.replace(LAYOUT, state_format="", state_nbytes=0).key == LAYOUT.key  # plain keys unchanged
    other = StateSpec(2, mamba2_kind(4, 12, 2, 5, 7))
    assert dataclasses.replace(HYBRID, state_format=other.format, state_nbytes=other.bytes_per_sequence).key != HYBRID.key


def test_a_snapshot_goes_down_to_disk_and_comes_back_bit_for_bit(tmp_path):
    pool = pool_with_states()
    chain = make_chain(3, HYBRID)
    tm = TierManager(HYBRID, host_bytes=HYBRID.state_nbytes + 10, disk_root=tmp_path, disk_bytes=BIG)
    off = bridge(tm, pool)
    expected = [[t.clone() for t in pool.slot_views(s)] for s in range(3)]
    for slot, (h, *_rest) in enumerate(chain):
        off.offer_state(slot, h)
    s = tm.stats()
    assert (s.host_states, s.disk_states, s.states_saved) == (1, 2, 3)  # one fits the host budget
    assert tm.host.used_bytes <= tm.host.capacity_bytes
    for t in pool.tensors.values():
        t.zero_()
    for slot, (h, *_rest) in enumerate(chain):
        assert off.contains_state(h) and off.fetch_state(h, slot)
        assert all(torch.equal(a, b) for a, b in zip(pool.slot_views(slot), expected[slot]))
    s = tm.stats()
    assert (s.state_host_hits, s.state_disk_hits, s.state_misses) == (1, 2, 0)
    assert not off.contains_state(b"\1" * 32) and not off.fetch_state(b"\1" * 32, 3) and tm.stats().state_misses == 1


def test_states_and_blocks_share_the_host_lru(tmp_path):
    pool = pool_with_states()
    chain = make_chain(2, HYBRID)
    tm = TierManager(HYBRID, host_bytes=HYBRID.block_nbytes + HYBRID.state_nbytes, disk_root=tmp_path, disk_bytes=BIG)
    h0, p0, t0, k0, v0 = chain[0]
    tm.save(h0, p0, t0, k0, v0)
    tm.save_state(h0, pool.slot_views(0))
    h1, p1, t1, k1, v1 = chain[1]
    tm.save(h1, p1, t1, k1, v1)  # the oldest entry (block 0) goes down to disk, its state stays
    assert tm.lookup(h0) == "disk" and tm.host.has_state(h0) and tm.lookup(h1) == "cpu"
    assert tm.host.num_blocks == 1 and tm.host.num_states == 1
    assert tm.host.used_bytes <= tm.host.capacity_bytes


def test_a_restart_finds_the_states_and_damaged_or_foreign_ones_are_misses(tmp_path, caplog):
    pool = pool_with_states()
    chain = make_chain(3, HYBRID)
    tm = TierManager(HYBRID, host_bytes=BIG, disk_root=tmp_path, disk_bytes=BIG)
    off = bridge(tm, pool)
    for slot, (h, *_rest) in enumerate(chain):
        off.offer_state(slot, h)
    expected = [t.clone() for t in pool.slot_views(2)]
    assert tm.flush() == 3
    files = sorted(tm.disk.dir.glob(f"*{STATE_SUFFIX}"))
    assert len(files) == 3
    # damage: a flipped payload byte in block 0's state, block 1's state removed
    path0 = tm.disk.states.path(chain[0][0])
    data = bytearray(path0.read_bytes())
    data[-5] ^= 0x40
    path0.write_bytes(bytes(data))
    tm.disk.states.path(chain[1][0]).unlink()
    again = TierManager(HYBRID, host_bytes=BIG, disk_root=tmp_path, disk_bytes=BIG)
    assert again.stats().disk_states == 2  # the removed one is gone; the start-up check reads no payload
    fresh = pool_with_states(seed=1)
    off2 = bridge(again, fresh)
    before = [t.clone() for t in fresh.slot_views(0)]
    assert not off2.fetch_state(chain[0][0], 0)  # checksum mismatch: deleted, slot untouched
    assert all(torch.equal(a, b) for a, b in zip(fresh.slot_views(0), before))
    assert not path0.exists() and not off2.contains_state(chain[0][0])
    assert not off2.fetch_state(chain[1][0], 1)  # gone: a miss
    assert off2.fetch_state(chain[2][0], 2)
    assert all(torch.equal(a, b) for a, b in zip(fresh.slot_views(2), expected))
    s = again.stats()
    assert s.corrupt_blocks == 1 and s.state_misses == 2 and s.state_disk_hits == 1
    # another state format under the same model: its own folder, nothing shared
    other = StateSpec(3, SPEC.kind)
    foreign = dataclasses.replace(HYBRID, state_format=other.format, state_nbytes=other.bytes_per_sequence)
    tm3 = TierManager(foreign, host_bytes=BIG, disk_root=tmp_path, disk_bytes=BIG)
    assert not tm3.has_state(chain[2][0])


def test_a_state_file_renamed_onto_another_hash_is_refused(tmp_path):
    pool = pool_with_states()
    chain = make_chain(2, HYBRID)
    tm = TierManager(HYBRID, host_bytes=0, disk_root=tmp_path, disk_bytes=BIG)
    off = bridge(tm, pool)
    off.offer_state(0, chain[0][0])
    tm.disk.states.path(chain[0][0]).rename(tm.disk.states.path(chain[1][0]))
    again = TierManager(HYBRID, host_bytes=0, disk_root=tmp_path, disk_bytes=BIG)
    assert again.has_state(chain[1][0])
    assert not bridge(again, pool).fetch_state(chain[1][0], 1) and again.stats().corrupt_blocks == 1


def test_disk_budget_counts_state_files(tmp_path):
    pool = pool_with_states()
    chain = make_chain(4, HYBRID)
    size = HYBRID.state_nbytes + 400  # a state file's payload and its header
    tm = TierManager(HYBRID, host_bytes=0, disk_root=tmp_path, disk_bytes=2 * size)
    off = bridge(tm, pool)
    for slot, (h, *_rest) in enumerate(chain):
        off.offer_state(slot, h)
    assert tm.disk.used_bytes <= 2 * size and tm.stats().disk_states == 2
    assert [tm.has_state(h) for h, *_ in chain] == [False, False, True, True]  # least recently used went first


def test_swap_space_carries_a_state():
    pool = pool_with_states()
    tm = TierManager(HYBRID, host_bytes=BIG)
    off = bridge(tm, pool)
    off.k_pool.normal_()
    expected_k = off.k_pool[:, [1, 2]].clone()
    expected = [t.clone() for t in pool.slot_views(1)]
    assert off.swap_out("s", [1, 2], state_slot=1)
    assert tm.host.swap_bytes == 2 * HYBRID.block_nbytes + HYBRID.state_nbytes
    off.k_pool.zero_()
    for t in pool.tensors.values():
        t.zero_()
    assert off.swap_in("s", [0, 3], state_slot=2)
    assert torch.equal(off.k_pool[:, [0, 3]], expected_k)
    assert all(torch.equal(a, b) for a, b in zip(pool.slot_views(2), expected))
    assert tm.host.used_bytes == 0
    with pytest.raises(ValueError):
        PoolOffload(tm, off.k_pool, off.v_pool, StatePool(StateSpec(3, SPEC.kind), 1))
