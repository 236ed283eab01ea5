"""TierManager: eviction walks host -> disk, lookups and loads walk back, counters, swap space, restart, config."""

import logging

import pytest
import torch

from edgeserve.offload import OffloadConfig, TierManager
from edgeserve.offload.config import default_disk_kv_path

from offload_helpers import LAYOUT, make_chain

BIG = 1 << 30


def _save_all(tm, chain):
    return [tm.save(h, p, t, k, v) for h, p, t, k, v in chain]


def test_host_overflow_moves_down_to_disk_and_loads_come_back_bit_exact(tmp_path):
    chain = make_chain(6)
    tm = TierManager(LAYOUT, host_bytes=2 * LAYOUT.block_nbytes, disk_root=tmp_path, disk_bytes=BIG)
    assert _save_all(tm, chain) == ["cpu"] * 6
    assert [tm.lookup(e[0]) for e in chain] == ["disk"] * 4 + ["cpu"] * 2
    for h, p, t, k, v in chain:
        got = tm.load(h)
        assert got is not None and torch.equal(got[0], k) and torch.equal(got[1], v)
    s = tm.stats()
    assert (s.host_blocks, s.disk_blocks, s.host_hits, s.disk_hits, s.misses) == (2, 4, 2, 4, 0)
    nb = LAYOUT.block_nbytes
    assert s.bytes_device_to_host == 6 * nb and s.bytes_host_to_disk == 4 * nb
    assert s.bytes_host_to_device == 2 * nb and s.bytes_disk_to_device == 4 * nb
    assert tm.lookup(b"\1" * 32) is None and tm.load(b"\1" * 32) is None and tm.stats().misses == 1


def test_saved_copy_survives_the_pool_slot_being_overwritten():
    chain = make_chain(1)
    h, p, t, k, v = chain[0]
    pool_k, pool_v = k.clone(), v.clone()
    tm = TierManager(LAYOUT, host_bytes=BIG)
    tm.save(h, p, t, pool_k, pool_v)
    pool_k.fill_(7)
    pool_v.fill_(7)
    dst_k, dst_v = torch.zeros_like(k), torch.zeros_like(v)
    assert tm.load_into(h, dst_k, dst_v)
    assert torch.equal(dst_k, k) and torch.equal(dst_v, v)


def test_saving_a_resident_block_again_copies_nothing(tmp_path):
    chain = make_chain(1)
    tm = TierManager(LAYOUT, host_bytes=BIG, disk_root=tmp_path, disk_bytes=BIG)
    _save_all(tm, chain)
    _save_all(tm, chain)
    assert tm.stats().bytes_device_to_host == LAYOUT.block_nbytes


def test_host_only_drops_what_falls_off(tmp_path):
    chain = make_chain(3)
    tm = TierManager(LAYOUT, host_bytes=2 * LAYOUT.block_nbytes)
    _save_all(tm, chain)
    assert tm.lookup(chain[0][0]) is None and tm.load(chain[0][0]) is None
    assert tm.stats().disk_blocks == 0 and not tm.stats().disk_enabled


def test_flush_then_a_new_manager_finds_everything_on_disk(tmp_path):
    chain = make_chain(5)
    tm = TierManager(LAYOUT, host_bytes=3 * LAYOUT.block_nbytes, disk_root=tmp_path, disk_bytes=BIG)
    _save_all(tm, chain)
    assert tm.flush() == 3 and tm.flush() == 0
    restarted = TierManager(LAYOUT, host_bytes=3 * LAYOUT.block_nbytes, disk_root=tmp_path, disk_bytes=BIG)
    assert [restarted.lookup(e[0]) for e in chain] == ["disk"] * 5
    for h, p, t, k, v in chain:
        got = restarted.load(h)
        assert torch.equal(got[0], k) and torch.equal(got[1], v)
    assert restarted.stats().disk_hits == 5


def test_corrupt_disk_block_is_a_miss_not_an_error(tmp_path):
    chain = make_chain(3)
    tm = TierManager(LAYOUT, host_bytes=LAYOUT.block_nbytes, disk_root=tmp_path, disk_bytes=BIG)
    _save_all(tm, chain)
    path = tm.disk.path(chain[0][0])
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    assert tm.lookup(chain[0][0]) == "disk"  # claimed, but verification on load fails
    assert tm.load(chain[0][0]) is None
    s = tm.stats()
    assert s.corrupt_blocks == 1 and s.misses == 1 and tm.lookup(chain[0][0]) is None


def test_unwritable_disk_path_degrades_to_host_only(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    chain = make_chain(4)
    with caplog.at_level(logging.WARNING, logger="edgeserve.offload"):
        cfg = OffloadConfig("cpu,disk", cpu_kv_gb=2 * LAYOUT.block_nbytes / (1 << 30), disk_kv_path=str(blocker / "kv"))
        tm = TierManager.from_config(cfg, LAYOUT)
        _save_all(tm, chain)
    assert len([r for r in caplog.records if "turned off" in r.getMessage()]) == 1
    assert [tm.lookup(e[0]) for e in chain] == [None, None, "cpu", "cpu"]
    assert torch.equal(tm.load(chain[3][0])[0], chain[3][3])


def test_swap_out_and_in_round_trip_and_counters(tmp_path):
    tm = TierManager(LAYOUT, host_bytes=4 * LAYOUT.block_nbytes, disk_root=tmp_path, disk_bytes=BIG)
    chain = make_chain(4)
    _save_all(tm, chain)
    k = torch.randn(3, 3, 4, 2, 8).to(torch.bfloat16)  # a sequence of 3 blocks: [layers, blocks, bs, heads, dim]
    v = torch.randn(3, 3, 4, 2, 8).to(torch.bfloat16)
    k_orig = k.clone()
    assert tm.swap_out("req-1", k, v) and tm.is_swapped("req-1")
    k.zero_()  # the pool blocks are reused right after
    # The swap pushed three cached blocks down to disk instead of dropping them.
    assert [tm.lookup(e[0]) for e in chain] == ["disk"] * 3 + ["cpu"]
    assert not tm.swap_out("req-2", k, v)  # no room: the caller recomputes
    got_k, got_v = tm.swap_in("req-1")
    assert torch.equal(got_k, k_orig) and torch.equal(got_v, v)
    assert tm.swap_in("req-1") is None and not tm.is_swapped("req-1")
    s = tm.stats()
    assert (s.swap_outs, s.swap_ins, s.swap_out_failures) == (1, 1, 1)
    tm.swap_out("req-3", k, v)
    tm.drop_swap("req-3")
    assert tm.host.used_bytes == LAYOUT.block_nbytes


def test_config_validation_and_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path))
    assert OffloadConfig().kv_offload == "none" and not OffloadConfig().use_cpu
    assert TierManager.from_config(OffloadConfig(), LAYOUT) is None
    cfg = OffloadConfig("cpu, disk", cpu_kv_gb=1, disk_kv_gb=0.5)
    assert cfg.use_cpu and cfg.use_disk and cfg.cpu_kv_bytes == 1 << 30 and cfg.disk_kv_bytes == 1 << 29
    assert cfg.disk_path == default_disk_kv_path() == tmp_path / "kv"
    assert OffloadConfig("cpu").use_disk is False
    for bad in (dict(kv_offload="gpu"), dict(kv_offload="disk"), dict(cpu_kv_gb=0), dict(disk_kv_gb=-1)):
        with pytest.raises(ValueError):
            OffloadConfig(**bad)


def test_model_identity_changes_with_content(tmp_path):
    from edgeserve.offload import model_identity

    a = tmp_path / "a.gguf"
    a.write_bytes(b"x" * 3_000_000)
    first = model_identity(a)
    assert model_identity(a) == first and model_identity(a, extra="bf16") != first
    data = bytearray(a.read_bytes())
    data[-10] ^= 1
    a.write_bytes(bytes(data))
    assert model_identity(a) != first
