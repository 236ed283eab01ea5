"""DiskTier: bit-exact round trips, restart, corruption and foreign files, atomic writes, budget, bad paths."""

import dataclasses
import errno
import logging
import os
import time

import pytest
import torch

from edgeserve.offload import DiskTier
from edgeserve.offload.block_file import PREFIX_SIZE

from offload_helpers import LAYOUT, make_chain

BIG = 1 << 30


def _fill(tier: DiskTier, chain) -> None:
    for h, p, t, k, v in chain:
        assert tier.put(h, p, t, k, v)


def test_round_trip_is_bit_exact_and_keeps_the_key(tmp_path):
    chain = make_chain(3)
    tier = DiskTier(tmp_path, LAYOUT, BIG)
    _fill(tier, chain)
    for h, p, t, k, v in chain:
        got = tier.get(h)
        assert got is not None and got.parent_hash == p and got.token_ids == t
        assert got.k.dtype == torch.bfloat16 and torch.equal(got.k, k) and torch.equal(got.v, v)
    assert tier.get(b"\0" * 32) is None


def test_restart_finds_blocks_and_lru_order(tmp_path):
    chain = make_chain(4)
    tier = DiskTier(tmp_path, LAYOUT, BIG)
    _fill(tier, chain)
    for i, (h, *_rest) in enumerate(chain):  # distinct mtimes, oldest first, then touch chain[0]
        os.utime(tier.path(h), (1000 + i, 1000 + i))
    tier.get(chain[0][0])
    size = tier.used_bytes // 4
    again = DiskTier(tmp_path, LAYOUT, 3 * size)  # a smaller budget on restart evicts the oldest: chain[1]
    assert again.num_blocks == 3 and chain[1][0] not in again and chain[0][0] in again
    h, p, t, k, v = chain[3]
    got = again.get(h)
    assert torch.equal(got.k, k) and torch.equal(got.v, v)


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "flip_prefix", "truncate", "empty", "extend"])
def test_corrupt_file_is_detected_ignored_and_deleted(tmp_path, damage, caplog):
    chain = make_chain(2)
    tier = DiskTier(tmp_path, LAYOUT, BIG)
    _fill(tier, chain)
    path = tier.path(chain[0][0])
    size = path.stat().st_size
    if damage == "flip_payload":
        _flip(path, size - 5)
    elif damage == "flip_header":
        _flip(path, PREFIX_SIZE + 3)
    elif damage == "flip_prefix":
        _flip(path, 12)  # the payload length
    elif damage == "truncate":
        os.truncate(path, size - 100)
    elif damage == "empty":
        os.truncate(path, 0)
    else:
        with open(path, "ab") as f:
            f.write(b"\0" * 16)
    restarted = DiskTier(tmp_path, LAYOUT, BIG)
    with caplog.at_level(logging.WARNING, logger="edgeserve.offload"):
        assert restarted.get(chain[0][0]) is None
    assert "corrupt" in caplog.text
    assert not path.exists() and chain[0][0] not in restarted and restarted.num_corrupt == 1
    assert restarted.get(chain[1][0]) is not None  # the healthy neighbour is still served


def test_another_models_file_under_this_name_is_rejected(tmp_path):
    other_layout = dataclasses.replace(LAYOUT, model_id="another-model")
    mine, theirs = make_chain(1), make_chain(1, layout=other_layout, seed=1)
    tier = DiskTier(tmp_path, LAYOUT, BIG)
    other = DiskTier(tmp_path, other_layout, BIG)
    _fill(tier, mine)
    _fill(other, theirs)  # same tokens, same hash: another model's KV for the same prefix
    assert tier.dir != other.dir
    other.path(theirs[0][0]).replace(tier.path(mine[0][0]))
    fresh = DiskTier(tmp_path, LAYOUT, BIG)
    assert fresh.get(mine[0][0]) is None and fresh.num_corrupt == 1


def test_renamed_file_for_another_hash_is_rejected(tmp_path):
    chain = make_chain(2)
    tier = DiskTier(tmp_path, LAYOUT, BIG)
    _fill(tier, chain)
    tier.path(chain[1][0]).replace(tier.path(chain[0][0]))
    fresh = DiskTier(tmp_path, LAYOUT, BIG)
    assert fresh.get(chain[0][0]) is None and fresh.get(chain[1][0]) is None


def test_other_dtype_or_block_size_does_not_see_the_blocks(tmp_path):
    chain = make_chain(1)
    _fill(DiskTier(tmp_path, LAYOUT, BIG), chain)
    for changed in (dataclasses.replace(LAYOUT, dtype=torch.float16), dataclasses.replace(LAYOUT, block_size=8)):
        assert DiskTier(tmp_path, changed, BIG).get(chain[0][0]) is None
    assert DiskTier(tmp_path, LAYOUT, BIG).get(chain[0][0]) is not None


def test_leftover_temp_file_is_never_trusted(tmp_path):
    chain = make_chain(1)
    h = chain[0][0]
    writer = DiskTier(tmp_path, LAYOUT, BIG)
    _fill(writer, chain)
    # A crash between write and rename leaves only the temp file (here: a complete, valid one).
    final = writer.path(h)
    stale = final.with_name(f".tmp-{final.name}-123-abcd")
    fresh_tmp = final.with_name(f".tmp-{final.name}-456-beef")
    final.rename(stale)
    fresh_tmp.write_bytes(stale.read_bytes())
    os.utime(stale, (time.time() - 3600,) * 2)
    restarted = DiskTier(tmp_path, LAYOUT, BIG)
    assert h not in restarted and restarted.get(h) is None and restarted.num_blocks == 0
    assert not stale.exists()  # an old leftover is cleaned up
    assert fresh_tmp.exists()  # a young one may belong to a live writer: left alone, still not read


def test_write_is_atomic_when_interrupted(tmp_path, monkeypatch):
    chain = make_chain(1)
    tier = DiskTier(tmp_path, LAYOUT, BIG)
    real_replace = os.replace

    def crash(src, dst):
        raise KeyboardInterrupt  # the process dies between write and rename
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        _fill(tier, chain)
    monkeypatch.setattr(os, "replace", real_replace)
    assert not tier.path(chain[0][0]).exists()
    assert not [p for p in tier.dir.iterdir() if p.name.startswith(".tmp-")]
    assert DiskTier(tmp_path, LAYOUT, BIG).get(chain[0][0]) is None


def _disk_bytes(root) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.kvb"))


def test_budget_is_never_exceeded_and_shared_across_models(tmp_path):
    chain = make_chain(12)
    one = DiskTier(tmp_path, LAYOUT, BIG)
    h, p, t, k, v = chain[0]
    one.put(h, p, t, k, v)
    file_size = one.used_bytes
    budget = 5 * file_size + file_size // 2
    tier = DiskTier(tmp_path, LAYOUT, budget)
    other_layout = dataclasses.replace(LAYOUT, model_id="another-model")
    for i, (h, p, t, k, v) in enumerate(chain[1:]):
        assert tier.put(h, p, t, k, v)
        assert tier.used_bytes == _disk_bytes(tmp_path) <= budget
    assert tier.num_blocks == 5 and [e[0] in tier for e in chain[-5:]] == [True] * 5
    # Another model's tier with the same budget evicts the first model's oldest files.
    other = DiskTier(tmp_path, other_layout, budget)
    for h, p, t, k, v in make_chain(3, layout=other_layout, seed=2):
        other.put(h, p, t, k, v)
        assert _disk_bytes(tmp_path) <= budget
    assert DiskTier(tmp_path, LAYOUT, budget).num_blocks == 2
    # A block bigger than the whole budget is refused, not written.
    tiny = DiskTier(tmp_path / "tiny", LAYOUT, file_size // 2)
    assert not tiny.put(h, p, t, k, v) and _disk_bytes(tmp_path / "tiny") == 0


def test_unwritable_path_warns_once_and_misses(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    chain = make_chain(3)
    with caplog.at_level(logging.WARNING, logger="edgeserve.offload"):
        tier = DiskTier(blocker / "kv", LAYOUT, BIG)
        for h, p, t, k, v in chain:
            assert tier.put(h, p, t, k, v) is False
            assert tier.get(h) is None
    assert not tier.enabled
    assert len([r for r in caplog.records if "turned off" in r.getMessage()]) == 1


def test_full_disk_turns_the_tier_off_with_one_warning(tmp_path, monkeypatch, caplog):
    chain = make_chain(4)
    tier = DiskTier(tmp_path, LAYOUT, BIG)
    _fill(tier, chain[:1])
    real_open = open

    def full_open(path, mode="r", *args, **kwargs):
        if "w" in mode and ".tmp-" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *args, **kwargs)
    monkeypatch.setattr("builtins.open", full_open)
    with caplog.at_level(logging.WARNING, logger="edgeserve.offload"):
        for h, p, t, k, v in chain[1:]:
            assert tier.put(h, p, t, k, v) is False
    monkeypatch.setattr("builtins.open", real_open)
    assert not tier.enabled
    assert len([r for r in caplog.records if "turned off" in r.getMessage()]) == 1
    assert not [p for p in tier.dir.iterdir() if p.name.startswith(".tmp-")]
    assert tier.get(chain[0][0]) is not None  # what is already on disk stays readable
