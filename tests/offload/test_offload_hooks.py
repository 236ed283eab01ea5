"""Offload wired into the BlockManager and the Scheduler, over a real tensor KV pool and a fake model.

The fake model writes each token id (K) and position (V) into the pool's slots and samples from the context it
reads back through the block tables, so a block fetched from a tier or swapped back in with wrong content, in the
wrong place, or not at all changes the outputs.
"""

import random

import pytest
import torch
from support.scheduler_runs import run_scheduler

from edgeserve.engine.cache.kv_blocks import block_hash
from edgeserve.engine.sched.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, Sequence
from edgeserve.offload import KVLayout, TierManager
from edgeserve.offload.pool_bridge import PoolOffload

BS = 4
LAYOUT = KVLayout("fake-model", torch.float32, num_layers=2, block_size=BS, num_kv_heads=1, head_dim=1)


class TensorModel:
    """A fake model over a real KV pool [layers, blocks, BS, 1, 1]."""

    def __init__(self, num_blocks: int) -> None:
        self.k = torch.full((2, num_blocks, BS, 1, 1), -1.0)
        self.v = torch.full((2, num_blocks, BS, 1, 1), -1.0)

    def step(self, out: SchedulerOutput) -> dict:
        sampled = {}
        for s in out.scheduled:
            slots = torch.tensor(s.slot_mapping)
            self.k.view(2, -1)[:, slots] = torch.tensor(s.token_ids, dtype=torch.float32)
            self.v.view(2, -1)[:, slots] = torch.tensor(s.positions, dtype=torch.float32)
            if s.samples:
                table = torch.tensor(s.block_table)
                k = self.k[:, table].reshape(2, -1)[:, :s.context_len]
                v = self.v[:, table].reshape(2, -1)[:, :s.context_len]
                assert torch.equal(v[0], torch.arange(s.context_len, dtype=torch.float32)), "positions garbled"
                assert torch.equal(k[0], k[1])
                sampled[s.seq_id] = [hash(tuple(k[0].long().tolist())) % 1000]
        return sampled


def make(num_blocks: int, tmp_path=None, host_blocks: int = 0, disk: bool = False, budget: int = 512):
    model = TensorModel(num_blocks)
    offload = None
    if host_blocks or disk:
        tiers = TierManager(LAYOUT, host_bytes=host_blocks * LAYOUT.block_nbytes,
                            disk_root=tmp_path if disk else None, disk_bytes=1 << 30)
        offload = PoolOffload(tiers, model.k, model.v)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, block_size=BS)
    return Scheduler(cfg, num_blocks, offload=offload), model


def run(sched: Scheduler, model: TensorModel, requests: dict, max_tokens: dict, arrivals: dict | None = None) -> dict:
    """Drive until every request is done; check the pool's bookkeeping each step."""
    return run_scheduler(sched, model, requests, max_tokens, arrivals)


def sequential(sched, model, requests, max_tokens) -> dict:
    """One request at a time (each finishes before the next arrives)."""
    out = {}
    for sid in requests:
        out.update(run(sched, model, {sid: requests[sid]}, {sid: max_tokens[sid]}))
    return out


def _docs_workload(seed: int, n_docs: int = 3, n_requests: int = 12):
    """Requests that share long 'document' prefixes, more of them than a tiny pool holds."""
    rng = random.Random(seed)
    docs = [[rng.randrange(100) for _ in range(6 * BS)] for _ in range(n_docs)]
    requests = {i: docs[rng.randrange(n_docs)] + [rng.randrange(100) for _ in range(rng.randrange(1, 6))]
                for i in range(n_requests)}
    return requests, {i: rng.randrange(1, 6) for i in requests}


@pytest.mark.parametrize("seed", [0, 1])
def test_prefixes_come_back_from_host_and_disk_with_identical_outputs(tmp_path, seed):
    requests, max_tokens = _docs_workload(seed)
    reference = sequential(*make(200), requests, max_tokens)
    plain_sched, plain_model = make(10)  # tiny pool: one document at a time
    assert sequential(plain_sched, plain_model, requests, max_tokens) == reference
    sched, model = make(10, tmp_path, host_blocks=4, disk=True)
    assert sequential(sched, model, requests, max_tokens) == reference
    bm, stats = sched.block_manager, sched.offload.tiers.stats()
    assert stats.host_hits > 0 and stats.disk_hits > 0
    assert bm.num_prompt_tokens_fetched == BS * (stats.host_hits + stats.disk_hits)
    assert bm.num_prompt_tokens_computed < plain_sched.block_manager.num_prompt_tokens_computed


def shutdown(sched: Scheduler) -> None:
    """What the engine does when it stops: every cached block down to the tiers, the host tier onto disk."""
    sched.block_manager.offer_cached()
    sched.offload.tiers.flush()


def test_restart_serves_the_prefix_from_disk(tmp_path):
    requests, max_tokens = _docs_workload(3, n_docs=1, n_requests=2)
    reference = sequential(*make(200), requests, max_tokens)
    first, first_model = make(10, tmp_path, host_blocks=8, disk=True)
    assert run(first, first_model, {0: requests[0]}, {0: max_tokens[0]}) == {0: reference[0]}
    shutdown(first)
    second, second_model = make(10, tmp_path, host_blocks=8, disk=True)
    assert run(second, second_model, {1: requests[1]}, {1: max_tokens[1]}) == {1: reference[1]}
    assert second.block_manager.num_prompt_tokens_reused == 6 * BS  # the whole document
    assert second.offload.tiers.stats().disk_hits == 6


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_damaged_disk_block_is_recomputed_with_identical_output(tmp_path, damage):
    requests, max_tokens = _docs_workload(4, n_docs=1, n_requests=2)
    reference = sequential(*make(200), requests, max_tokens)
    first, first_model = make(10, tmp_path, host_blocks=8, disk=True)
    run(first, first_model, {0: requests[0]}, {0: max_tokens[0]})
    shutdown(first)
    disk = first.offload.tiers.disk
    chain, parent = [], b""
    for i in range(6):
        parent = block_hash(parent, tuple(requests[1][i * BS:(i + 1) * BS]))
        chain.append(parent)
    path = disk.path(chain[2])  # the third block: 0-1 come back from disk, 2-5 are recomputed
    data = bytearray(path.read_bytes())
    if damage == "flip":  # one byte in the middle of the K/V payload (not the header: that fails on its own)
        data[len(data) - disk.layout.block_nbytes // 2] ^= 0xFF  # the payload is the file's last bytes
    elif damage == "truncate":
        data = data[:-7]
    else:
        data = bytearray(disk.path(chain[3]).read_bytes())  # a valid block file, but for another key
    path.write_bytes(bytes(data))
    second, second_model = make(10, tmp_path, host_blocks=8, disk=True)
    assert run(second, second_model, {1: requests[1]}, {1: max_tokens[1]}) == {1: reference[1]}
    stats = second.offload.tiers.stats()
    assert stats.corrupt_blocks == 1 and stats.disk_hits == 2
    assert second.block_manager.num_prompt_tokens_reused == 2 * BS
    assert not path.exists()


def _concurrent_workload(seed: int):
    rng = random.Random(seed)
    requests = {i: [rng.randrange(100) for _ in range(rng.randrange(3, 14))] for i in range(8)}
    return requests, {i: rng.randrange(4, 16) for i in requests}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_swap_preemption_matches_unconstrained_run(seed):
    requests, max_tokens = _concurrent_workload(seed)
    reference = run(*make(200), requests, max_tokens)
    sched, model = make(9, host_blocks=64, budget=16)
    assert run(sched, model, requests, max_tokens) == reference
    stats = sched.offload.tiers.stats()
    assert sched.num_preemptions > 0 and stats.swap_outs > 0 and stats.swap_ins == stats.swap_outs
    assert sched.offload.tiers.host.num_swapped == 0


def test_full_host_tier_falls_back_to_recompute(seed=0):
    requests, max_tokens = _concurrent_workload(seed)
    reference = run(*make(200), requests, max_tokens)
    sched, model = make(9, host_blocks=1, budget=16)  # room for one block: most swaps are refused
    assert run(sched, model, requests, max_tokens) == reference
    stats = sched.offload.tiers.stats()
    assert stats.swap_out_failures > 0 and sched.num_preemptions == stats.swap_outs + stats.swap_out_failures


def test_abort_while_swapped_releases_swap_space():
    sched, model = make(3, host_blocks=64, budget=16)
    sched.add(Sequence("a", list(range(7))))
    sched.add(Sequence("b", list(range(20, 24))))
    for _ in range(6):
        out = sched.schedule()
        sched.update(out, model.step(out))
        if out.preempted:
            break
    assert out.preempted == ["b"] and sched.get("b").swapped
    assert sched.offload.tiers.host.num_swapped == 1
    sched.abort("b")
    assert sched.offload.tiers.host.num_swapped == 0 and sched.offload.tiers.host.used_bytes == 0
