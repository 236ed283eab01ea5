"""Prefix caching on a Qwen3.5 hybrid: a hit is usable only up to a block whose recurrent state was snapshotted (the
prompt's last full block, the latest block boundary of each sequence), so a second turn of a chat resumes after the
first turn, a prompt sharing part of another resumes at that prompt's snapshot even when the shared part ends
mid-block, and a shared prefix without a snapshot is recomputed; outputs equal a cold run's. Snapshots are evicted
with their blocks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgeserve.llm import LLM
from edgeserve.sampling_params import SamplingParams

from qwen35_helpers import VOCAB, hf_qwen35, write_qwen35_gguf

pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def cold(tmp_path_factory) -> LLM:
    path = write_qwen35_gguf(hf_qwen35(), tmp_path_factory.mktemp("qwen35") / "q.gguf")
    return LLM(str(path), dtype="float32", device="cpu", kv_cache_gb=0.01, enable_prefix_caching=False)


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, size=n).tolist()


def run(llm: LLM, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy output and how many prompt tokens the prefix cache supplied."""
    before = llm.engine.stats().prompt_tokens_reused
    out = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    return out, llm.engine.stats().prompt_tokens_reused - before


def check_snapshots(llm: LLM) -> None:
    """Seats all back; every snapshot belongs to a block still in the prefix cache; the pool accounts for all."""
    states, bm = llm.engine.states, llm.engine.scheduler.block_manager
    states.check()
    assert states.num_seated == 0
    assert set(states._snapshots) <= set(bm._by_hash)


def test_second_turn_resumes_after_the_first(cold: LLM) -> None:
    warm = LLM.from_model(cold.lm, kv_cache_gb=0.01)
    first = tokens(45, seed=1)
    reply, reused = run(warm, first)
    assert reused == 0 and reply == run(cold, first)[0]
    # the first turn's 57 tokens: its state was kept at 48 (the last block boundary it computed)
    second = first + reply + tokens(9, seed=2)
    out, reused = run(warm, second)
    assert reused == 48
    assert out == run(cold, second)[0]
    # the third turn resumes after the second
    third = second + out + tokens(5, seed=3)
    out3, reused = run(warm, third)
    assert reused == (len(second) + 12 - 1) // 16 * 16 and out3 == run(cold, third)[0]
    check_snapshots(warm)


def test_hits_stop_at_a_snapshot(cold: LLM) -> None:
    warm = LLM.from_model(cold.lm, kv_cache_gb=0.01, max_num_batched_tokens=64)
    base = tokens(45, seed=4)  # its prompt state is kept at 32: (45 - 1) // 16 * 16
    run(warm, base)
    # the same prompt again: resumes at 32
    again, reused = run(warm, base)
    assert reused == 32 and again == run(cold, base)[0]
    # sharing 40 tokens (a hit that ends mid-block): resumes at 32 too
    mid = base[:40] + tokens(10, seed=5)
    out, reused = run(warm, mid)
    assert reused == 32 and out == run(cold, mid)[0]
    # sharing 20 tokens: block 0 is cached, but no state was kept at 16: all recomputed
    short = base[:20] + tokens(15, seed=6)
    out, reused = run(warm, short)
    assert reused == 0 and out == run(cold, short)[0]
    check_snapshots(warm)


def test_snapshots_are_evicted_with_their_blocks(cold: LLM) -> None:
    """A pool of few blocks: many prompts evict each other's blocks, and their snapshots go with them."""
    per = cold.engine.states.budget.bytes_per_slot
    kv_block = 2 * 2 * 32 * 4 * 16
    small = LLM.from_model(cold.lm, kv_cache_gb=(8 * per + 5 * kv_block) / 2**30, max_num_seqs=4)
    budget = small.engine.states.budget
    assert (budget.seats, budget.snapshots, small.engine.scheduler.block_manager.num_blocks) == (4, 3, 6)
    for seed in range(3):
        prompt = tokens(40, seed=10 + seed)
        assert run(small, prompt)[0] == run(cold, prompt)[0]
        check_snapshots(small)
    assert small.engine.states.counters.snapshots_evicted > 0
