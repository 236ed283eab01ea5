"""Sliding-window layers keep their K/V in a window pool whose blocks a sequence holds only inside its window:
the engine on a Gemma-3-shaped tiny random model generates the same tokens with the pool as without it, the
sliding layers' blocks stay bounded by window / block_size + 1 while the global layers' grow, and prefix-cache
reuse (across the window, and after the window blocks of a cached prefix were taken) gives the same tokens."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support.scheduler_runs import run_scheduler

from edgeserve.engine.cache import kv_cache
from edgeserve.engine.config import EngineConfig
from edgeserve.engine.core import EngineCore
from edgeserve.engine.cache.kv_blocks import BlockManager
from edgeserve.loaders.hf_folder import HFFolder
from edgeserve.models.config import config_from_hf
from edgeserve.models.decoders import decoder_class
from edgeserve.models.load import LoadedModel
from edgeserve.sampling_params import SamplingParams

WINDOW, BS, VOCAB = 8, 4, 96


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> LoadedModel:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=512, num_hidden_layers=7, sliding_window=WINDOW,
        query_pre_attn_scalar=16, tie_word_embeddings=False)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # far from uniform attention, so a wrong window or a stale block changes the tokens
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.5 if "norm" in name else 0.15)
    folder = tmp_path_factory.mktemp("gemma3") / "hf"
    model.save_pretrained(folder)
    config = config_from_hf(json.loads((folder / "config.json").read_text()))
    assert set(config.layer_windows) == {WINDOW, None}
    ours = decoder_class(config).from_weights(config, HFFolder(folder).weights(), dtype=torch.float32)
    tokenizer = SimpleNamespace(eot_ids=frozenset(), decode=lambda ids: "", byte_fallback_ids=frozenset())
    return LoadedModel("tiny-gemma3", SimpleNamespace(path=folder), config, ours, tokenizer, None, 0.0)


def engine(lm: LoadedModel, window_pool: bool, monkeypatch, **kw) -> EngineCore:
    """An engine over `lm`, with the sliding layers in their window pool or (False) in the one pool of all layers."""
    if not window_pool:
        monkeypatch.setattr(kv_cache, "split_window", lambda config: None)
    kw = {"block_size": BS, "kv_cache_gb": 0.05, "max_num_seqs": 4, "max_num_batched_tokens": 16, **kw}
    core = EngineCore(lm, EngineConfig(**kw))
    monkeypatch.undo()
    assert (core.pool.window is not None) == window_pool
    return core


def generate(core: EngineCore, prompts: list[list[int]], n: int, watch=None) -> list[list[int]]:
    """Greedy `n` tokens for each prompt, all in one batch; `watch(core)` after every step."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    ids = [core.add_request(p, params) for p in prompts]
    out: dict[str, list[int]] = {i: [] for i in ids}
    while core.has_work():
        for o in core.step():
            out[o.request_id] += o.token_ids
        core.scheduler.block_manager.check_integrity()
        if watch is not None:
            watch(core)
    return [out[i] for i in ids]


PROMPTS = [[(7 * i + 3) % VOCAB for i in range(37)], [(5 * i + 11) % VOCAB for i in range(21)]]


def test_window_pool_is_bounded_and_gives_the_same_tokens(gemma, monkeypatch) -> None:
    ref = generate(engine(gemma, False, monkeypatch, enable_prefix_caching=False), PROMPTS, 60)
    core = engine(gemma, True, monkeypatch, enable_prefix_caching=False)
    bound = WINDOW // BS + 1
    seen = {"window": 0, "main": 0}

    def watch(core: EngineCore) -> None:
        bm = core.scheduler.block_manager
        for seq in core.scheduler.running:
            if seq.num_computed_tokens >= len(seq.prompt_token_ids):  # prefill done: only the window is held
                assert bm.window_blocks_held(seq.seq_id) <= bound
            seen["window"] = max(seen["window"], bm.window_blocks_held(seq.seq_id))
            seen["main"] = max(seen["main"], len(bm.block_table(seq.seq_id)))

    assert generate(core, PROMPTS, 60, watch) == ref
    assert seen["window"] == bound and seen["main"] >= (37 + 59) // BS  # the global layers hold the whole context
    assert core.pool.window_k.shape[1] < core.pool.k.shape[1]  # the window pool is the smaller one
    assert core.scheduler.block_manager.window.num_used == 0  # everything given back


def test_prefix_reuse_across_the_window_gives_the_same_tokens(gemma, monkeypatch) -> None:
    first = PROMPTS[0]
    ref_core = engine(gemma, False, monkeypatch, enable_prefix_caching=False)
    [ref_a] = generate(ref_core, [first], 20)
    turn2 = first + ref_a + [4, 9, 30]  # a follow-up turn: the whole first turn is a cached prefix
    [ref_b] = generate(ref_core, [turn2], 20)

    core = engine(gemma, True, monkeypatch)
    bm = core.scheduler.block_manager
    assert generate(core, [first], 20) == [ref_a]
    reused = bm.num_prompt_tokens_reused
    assert generate(core, [turn2], 20) == [ref_b]
    assert bm.num_prompt_tokens_reused - reused >= len(first) + len(ref_a) - BS  # reused well past the window
    assert generate(core, [first], 20) == [ref_a]  # the same prompt again: a hit on blocks behind the window too


def cached_prompt(n: int) -> tuple[BlockManager, object, list[int]]:
    """A block manager of 32 blocks with a window pool of 12, sequence "a" of tokens 0..n-1 in it, its K/V written
    and its full blocks committed to the prefix cache: (manager, window pool, tokens)."""
    bm = BlockManager(num_blocks=32, block_size=BS)
    window = bm.use_window(WINDOW, 12)
    tokens = list(range(n))
    bm.allocate("a", tokens)
    bm.slots("a", 0, n)
    bm.commit_full_blocks("a", tokens, n)
    return bm, window, tokens


def test_a_hit_whose_window_blocks_are_gone_is_shortened() -> None:
    """A cached prefix keeps its main blocks but its window blocks were handed to another sequence: the hit stops
    where the window blocks it needs are still there (here: nowhere), so the rest is recomputed."""
    bm, window, tokens = cached_prompt(40)
    assert bm.window_blocks_held("a") == WINDOW // BS + 1 - 1  # next query at 40 sees 33..39: blocks 8, 9
    bm.free("a")
    bm.check_integrity()
    # the same prompt: all 9 full blocks (the last token excluded) hit, and the window blocks of 8 are still paired
    assert bm.allocate("b", tokens[:37]) == 36
    assert bm.window_blocks_held("b") == 2  # next query at 36 sees 29..35: blocks 7, 8
    bm.free("b")
    # another prompt takes every window block: the cached prefix of `a` loses its sliding-layer K/V
    other = [100 + t for t in range(48)]
    bm.allocate("c", other)
    bm.slots("c", 0, 48)
    assert window.num_used == 12
    bm.free("c")
    assert bm.allocate("d", tokens[:37]) == 0  # no window blocks left for the prefix: computed again
    bm.check_integrity()


def test_preempted_and_recomputed_sequences_give_the_same_tokens(gemma, monkeypatch) -> None:
    ref = generate(engine(gemma, False, monkeypatch, enable_prefix_caching=False), PROMPTS, 60)
    # the window pool's blocks and 40 blocks of 4 tokens for the global layer: the two sequences (97 and 81 tokens
    # at the end) cannot both stay
    c = gemma.config
    layer_block = 2 * c.num_kv_heads * c.head_dim * 4 * BS
    window_blocks = kv_cache.window_pool_blocks(WINDOW, BS, 4, 16)
    n_sliding = sum(w is not None for w in c.layer_windows)
    budget = (window_blocks * n_sliding + 40.5 * (c.num_layers - n_sliding)) * layer_block
    # no decode-slowdown pacing: its step timings would make the preemption depend on the machine's load
    core = engine(gemma, True, monkeypatch, kv_cache_gb=budget / 2**30, max_decode_slowdown=None)
    assert core.pool.k.shape[1] == 40 and core.pool.window_k.shape[1] == window_blocks
    assert generate(core, PROMPTS, 60) == ref
    assert core.scheduler.num_preemptions > 0


class WindowFakeModel:
    """Writes each fed token into a fake main pool and a fake window pool (through the main-to-window block map, as
    the attention side does) and samples a hash of what it reads back: the whole context from the main pool, the
    last WINDOW positions from the window pool, which must hold exactly those tokens."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.main: list = [None] * (bm.num_blocks * BS)
        self.window: list = [None] * (bm.window.num_blocks * BS) if bm.window is not None else None

    def _window_slot(self, table: list[int], p: int) -> int:
        w = self.bm.window.of_block[table[p // BS]]
        assert w >= 0, "a position inside the window has no window block"
        return w * BS + p % BS

    def step(self, out) -> dict:
        sampled = {}
        for s in out.scheduled:
            for tok, pos, slot in zip(s.token_ids, s.positions, s.slot_mapping):
                self.main[slot] = (pos, tok)
                if self.window is not None:
                    self.window[self._window_slot(s.block_table, pos)] = (pos, tok)
            if s.samples:
                ctx = [self.main[s.block_table[p // BS] * BS + p % BS] for p in range(s.context_len)]
                assert [c[0] for c in ctx] == list(range(s.context_len))
                if self.window is not None:
                    recent = range(max(0, s.context_len - WINDOW), s.context_len)
                    assert [self.window[self._window_slot(s.block_table, p)] for p in recent] == ctx[-len(recent):]
                sampled[s.seq_id] = [hash(tuple(c[1] for c in ctx)) % 50]
        return sampled


def drive(sched, requests: dict, max_tokens: dict, arrivals: dict) -> dict:
    """Run the scheduler over WindowFakeModel until every request is done, checking the pools every step."""
    bm = sched.block_manager

    def window_bounded() -> None:
        if bm.window is not None:
            for seq in sched.running:
                if seq.num_computed_tokens >= seq.num_tokens - 1:
                    assert bm.window_blocks_held(seq.seq_id) <= WINDOW // BS + 1
    return run_scheduler(sched, WindowFakeModel(bm), requests, max_tokens, arrivals, after_step=window_bounded)


@pytest.mark.parametrize("seed", range(4))
def test_window_pool_sized_by_the_bound_never_runs_out(seed: int) -> None:
    """Random requests sharing prefixes, arriving over time, in a tight main pool (preemptions) with the window pool
    at `window_pool_blocks`: the same outputs as one pool of all layers, and no window block ever missing."""
    import random

    from edgeserve.engine.sched.scheduler import Scheduler, SchedulerConfig

    rng = random.Random(seed)
    stems = [[rng.randrange(50) for _ in range(rng.randrange(5, 40))] for _ in range(3)]
    requests, max_tokens, arrivals = {}, {}, {}
    for i in range(12):
        requests[i] = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randrange(1, 20))]
        max_tokens[i], arrivals[i] = rng.randrange(1, 40), rng.randrange(0, 30)
    seqs, budget = 4, 12

    def sched(window: bool, num_blocks: int) -> Scheduler:
        s = Scheduler(SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, block_size=BS), num_blocks)
        if window:
            s.block_manager.use_window(WINDOW, kv_cache.window_pool_blocks(WINDOW, BS, seqs, budget))
        return s

    reference = drive(sched(False, 400), requests, max_tokens, arrivals)
    tight = sched(True, 30)
    assert drive(tight, requests, max_tokens, arrivals) == reference
    assert tight.num_preemptions > 0 and tight.block_manager.num_prompt_tokens_reused > 0
    assert tight.block_manager.window.num_used == 0


def test_rolled_back_speculative_tokens_give_their_window_blocks_back() -> None:
    bm, window, tokens = cached_prompt(30)
    held = bm.window_blocks_held("a")
    assert bm.ensure_capacity("a", 30 + 9)  # one decode token and 8 drafts: blocks 7..9
    bm.slots("a", 30, 39)
    assert bm.window_blocks_held("a") == held + 2
    bm.truncate("a", 31)  # only the decode token's KV stays
    bm.commit_full_blocks("a", tokens + [1], 31)
    bm.check_integrity()
    assert bm.window_blocks_held("a") <= WINDOW // BS + 1 and len(bm.block_table("a")) == 8
    bm.free("a")
    assert window.num_used == 0
    bm.check_integrity()
