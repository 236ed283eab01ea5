"""Disk tier self-repair (issue 22): damaged block files found at start-up or on read leave the index and are written
again once recomputed, after one restart; things that are not regular files are skipped, never turning the tier off."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from edgeserve.engine.config import EngineConfig
from edgeserve.engine.core import EngineCore
from edgeserve.engine.cache.kv_blocks import block_hash
from edgeserve.engine.cache.kv_cache import kv_bytes_per_token
from edgeserve.models.load import load_model
from edgeserve.offload.block_file import decode
from edgeserve.registry import resolve
from edgeserve.sampling_params import SamplingParams
from tiny_gguf import write_tiny_llama

BS = 8
DOC_BLOCKS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("repair") / "tiny.gguf", hidden=64, heads=4, kv_heads=2)
    return load_model(resolve(str(path)))


def engine(lm, disk: Path) -> EngineCore:
    gib = kv_bytes_per_token(lm.config, lm.model.dtype) * BS / 2**30
    return EngineCore(lm, EngineConfig(block_size=BS, kv_cache_gb=40 * gib, kv_offload="cpu,disk",
                                       cpu_kv_gb=40 * gib, disk_kv_gb=1000 * gib, disk_kv_path=str(disk)))


def run(core: EngineCore, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy tokens and cached prompt tokens of one request, then close (cached blocks go down to disk)."""
    core.add_request(prompt, GREEDY, "r")
    tokens, cached = [], 0
    while core.has_work():
        for o in core.step():
            tokens += o.token_ids
            cached = o.num_cached_tokens
    core.close()
    return tokens, cached


@pytest.fixture
def prompt() -> list[int]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, 259, (DOC_BLOCKS * BS + 3,), generator=g).tolist()


def chain_files(core: EngineCore, prompt: list[int]) -> list[Path]:
    disk, parent, paths = core.offload.tiers.disk, b"", []
    for i in range(DOC_BLOCKS):
        parent = block_hash(parent, prompt[i * BS:(i + 1) * BS])
        paths.append(disk.path(parent))
    return paths


def test_many_damaged_blocks_are_all_rewritten_after_one_restart(tiny_lm, prompt, tmp_path):
    first = engine(tiny_lm, tmp_path)
    ref, _ = run(first, prompt)
    files = chain_files(first, prompt)
    assert all(p.is_file() for p in files)
    for i, path in enumerate(files):  # every block damaged: most inside the payload (only a read finds it)
        if i % 4 == 3:
            os.truncate(path, path.stat().st_size // 2)  # found at start-up
        else:
            data = bytearray(path.read_bytes())
            data[-50] ^= 0x40
            path.write_bytes(bytes(data))

    second = engine(tiny_lm, tmp_path)
    tokens, cached = run(second, prompt)
    assert tokens == ref and cached == 0  # all recomputed
    assert second.stats().offload.corrupt_blocks >= DOC_BLOCKS // 4 + 1
    layout = second.offload.tiers.disk.layout
    for path in files:  # all written again, whole and verified
        decode(bytearray(path.read_bytes()), layout, bytes.fromhex(path.name[:-4]))

    third = engine(tiny_lm, tmp_path)
    tokens, cached = run(third, prompt)
    s = third.stats().offload
    assert tokens == ref and cached == DOC_BLOCKS * BS
    assert s.disk_hits == DOC_BLOCKS and s.corrupt_blocks == 0


def test_non_regular_files_are_skipped_and_the_tier_stays_on(tiny_lm, prompt, tmp_path, caplog):
    probe = engine(tiny_lm, tmp_path)
    files = chain_files(probe, prompt)
    files[2].mkdir()  # a folder where a block file goes
    elsewhere = tmp_path / "elsewhere.kvb"
    elsewhere.write_bytes(b"not a block")
    files[5].symlink_to(elsewhere)  # a symlink: never read through, never replaced
    with caplog.at_level(logging.WARNING, logger="edgeserve.offload"):
        core = engine(tiny_lm, tmp_path)
        ref, _ = run(core, prompt)
    assert core.stats().offload.disk_enabled
    assert files[2].is_dir() and files[5].is_symlink() and elsewhere.read_bytes() == b"not a block"
    assert all(p.is_file() for i, p in enumerate(files) if i not in (2, 5))
    assert sum("not a regular file" in r.getMessage() for r in caplog.records) == 1
    assert not any("turned off" in r.getMessage() for r in caplog.records)

    again = engine(tiny_lm, tmp_path)
    tokens, cached = run(again, prompt)
    assert tokens == ref and cached == 2 * BS  # blocks 0 and 1 from disk; the chain breaks at the folder
    assert again.stats().offload.disk_enabled
