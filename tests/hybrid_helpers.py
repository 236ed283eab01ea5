"""What the engine tests of the hybrids with recurrent state beside the paged KV pool (LFM2, Nemotron-H, Granite 4 H)
share: converter-parity checkpoints, prompts, transformers' greedy reference, the state pool's emptiness check, and
the three engine checks each of them runs (greedy parity batched/alone/chunked, a second turn resumed from a state
snapshot, speculation rolling the states back)."""

from __future__ import annotations

import numpy as np
import torch

from converter_cases import BY_NAME
from converter_parity import build_checkpoint, tokenizer_folder
from support.hybrid_runs import assert_speculation_keeps_outputs

from edgeserve.llm import LLM
from edgeserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
VOCAB_USED = 30000  # prompt ids drawn below this (inside the borrowed vocabulary)


def make_checkpoint(name: str, default_model_path, tmp_path_factory):
    """(transformers model, HF folder) of the converter-parity case `name`."""
    tok = tokenizer_folder(default_model_path, tmp_path_factory.mktemp(f"{name}-tokenizer"))
    folder = tmp_path_factory.mktemp(name)
    return build_checkpoint(BY_NAME[name], tok, folder), folder


def prompts(*lens: int, seed: int = 0) -> list[list[int]]:
    """Random prompts of the given lengths."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB_USED, size=n).tolist() for n in lens]


def ids(results) -> list[list[int]]:
    """The first output's token ids of each result."""
    return [r.outputs[0].token_ids for r in results]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy generate of `n` tokens (its own state and KV caches), never stopping early."""
    config = model.generation_config.__class__(do_sample=False, max_new_tokens=n, eos_token_id=None,
                                               pad_token_id=0)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt):].tolist()


def assert_empty(llm: LLM) -> None:
    """No sequence holds a state seat; only snapshots use the pool."""
    states = llm.engine.states
    assert states is not None and states.num_seated == 0
    states.check()
    assert states.pool.num_used == states.num_snapshots


def check_greedy_equals_transformers(model, llm: LLM) -> None:
    """Greedy outputs equal transformers' batched, alone, and chunked (16-token steps)."""
    ps = prompts(5, 23, 40, 71)
    reference = [hf_greedy(model, p, 12) for p in ps]
    assert ids(llm.generate(ps, GREEDY)) == reference
    assert [ids(llm.generate([p], GREEDY))[0] for p in ps] == reference
    chunked = LLM.from_model(llm.lm, kv_cache_gb=0.01, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert ids(chunked.generate(ps, GREEDY)) == reference
    assert chunked.engine.stats().num_steps >= 71 // 16 + 11
    assert_empty(llm)
    assert_empty(chunked)


def check_second_turn_resumes(llm: LLM) -> None:
    """A second turn reuses the first turn's states (snapshot at its last block boundary) and outputs the same."""
    warm = LLM.from_model(llm.lm, kv_cache_gb=0.01)

    def run(prompt: list[int]) -> tuple[list[int], int]:
        before = warm.engine.stats().prompt_tokens_reused
        out = warm.generate([prompt], GREEDY)[0].outputs[0].token_ids
        return out, warm.engine.stats().prompt_tokens_reused - before

    first = prompts(45, seed=1)[0]
    reply, reused = run(first)
    assert reused == 0 and reply == ids(llm.generate([first], GREEDY))[0]
    second = first + reply + prompts(9, seed=2)[0]
    out, reused = run(second)
    assert reused == 48  # the first turn's states were kept at its last block boundary
    assert out == ids(llm.generate([second], GREEDY))[0]
    assert warm.engine.states.num_snapshots > 0
    assert_empty(warm)


def check_speculation_rolls_back(llm: LLM, prefix_caching: bool) -> None:
    """n-gram speculation with some drafts rejected outputs what plain decoding does (the states roll back)."""
    ps = prompts(13, 29, 40, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = [ids(llm.generate([p], params))[0] for p in ps]
    assert_empty(assert_speculation_keeps_outputs(llm.lm, ps, plain, params, prefix_caching))
