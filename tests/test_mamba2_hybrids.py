"""The Mamba-2 hybrids through the engine: Nemotron-H (Mamba-2 blocks beside attention and MLP blocks) and Granite
4 H (Mamba-2 or attention, then an MLP, in every layer). Each Mamba-2 layer's conv and ssm states live in a slot of
the state pool (the `mamba2` kind) beside the paged KV of the attention layers alone; greedy outputs equal
transformers' greedy generate, batched or alone, chunked or whole; a prefix-cache hit resumes from a state snapshot;
speculation rolls the states back. Logit parity of the GGUF and HF folder: test_registered_architectures'
`nemotron_h` and `granitehybrid` cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from converter_cases import BY_NAME  # noqa: E402
from converter_parity import build_checkpoint, tokenizer_folder  # noqa: E402
from test_qwen35_engine import OracleProposer  # noqa: E402

from edgeserve.llm import LLM  # noqa: E402
from edgeserve.sampling_params import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
VOCAB_USED = 30000  # prompt ids drawn below this (inside the borrowed vocabulary)


# case: (Mamba-2 layers, attention layers, conv channels H * P + 2 * G * N, ssm H x P x N)
SHAPES = {"nemotron_h": (3, 2, 8 * 16 + 2 * 2 * 16, 8 * 16 * 16),  # "M-*M-M*-": MLP blocks keep nothing
          "granitehybrid": (4, 2, 8 * 16 + 2 * 1 * 16, 8 * 16 * 16),
          "granitehybrid-moe": (4, 2, 8 * 16 + 2 * 1 * 16, 8 * 16 * 16)}  # experts beside the MLP


@pytest.fixture(scope="module", params=list(SHAPES))
def checkpoint(request, default_model_path, tmp_path_factory):
    """(transformers model, HF folder, case name) of a converter-parity case."""
    name = request.param
    tok = tokenizer_folder(default_model_path, tmp_path_factory.mktemp(f"{name}-tokenizer"))
    folder = tmp_path_factory.mktemp(name)
    return build_checkpoint(BY_NAME[name], tok, folder), folder, name


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(str(checkpoint[1]), dtype="float32", device="cpu", kv_cache_gb=0.01, enable_prefix_caching=False)


def prompts(*lens: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB_USED, size=n).tolist() for n in lens]


def ids(results) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy generate of `n` tokens (its own Mamba and KV caches), never stopping early."""
    config = model.generation_config.__class__(do_sample=False, max_new_tokens=n, eos_token_id=None,
                                               pad_token_id=0)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt):].tolist()


def assert_empty(llm: LLM) -> None:
    states = llm.engine.states
    assert states is not None and states.num_seated == 0
    states.check()
    assert states.pool.num_used == states.num_snapshots


def test_state_pool_holds_mamba2_states(checkpoint, llm: LLM) -> None:
    engine, c = llm.engine, llm.lm.config
    mamba, attention, channels, ssm = SHAPES[checkpoint[2]]
    spec = engine.states.pool.spec
    assert spec.kind.name == "mamba2" and spec.num_layers == mamba == c.num_linear_layers
    assert spec.bytes_per_sequence == mamba * ((4 - 1) * channels + ssm) * 4  # conv (K - 1) x channels, float32
    assert engine.pool.k.shape[0] == attention  # only the attention layers keep K/V


def test_greedy_equals_transformers_batched_or_alone(checkpoint, llm: LLM) -> None:
    model = checkpoint[0]
    ps = prompts(5, 23, 40, 71)
    reference = [hf_greedy(model, p, 12) for p in ps]
    assert ids(llm.generate(ps, GREEDY)) == reference
    assert [ids(llm.generate([p], GREEDY))[0] for p in ps] == reference
    chunked = LLM.from_model(llm.lm, kv_cache_gb=0.01, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert ids(chunked.generate(ps, GREEDY)) == reference
    assert chunked.engine.stats().num_steps >= 71 // 16 + 11
    assert_empty(llm)
    assert_empty(chunked)


def test_second_turn_resumes_from_a_state_snapshot(llm: LLM) -> None:
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


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_speculation_rolls_the_states_back(llm: LLM, prefix_caching: bool) -> None:
    ps = prompts(13, 29, 40, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = [ids(llm.generate([p], params))[0] for p in ps]
    spec = LLM.from_model(llm.lm, kv_cache_gb=0.01, speculative="ngram", num_speculative_tokens=3,
                          enable_prefix_caching=prefix_caching)
    spec.engine.spec.ngram = OracleProposer(ps, plain)
    assert ids(spec.generate(ps, params)) == plain
    stats = spec.engine.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens
    assert_empty(spec)


def test_experts_and_rope_are_refused_by_name() -> None:
    """The variants not run (Nemotron-H MoE blocks, Granite 4 H with RoPE) get a clear refusal."""
    from edgeserve.errors import UnsupportedModelError
    from edgeserve.models.config import config_from_hf

    nemotron = BY_NAME["nemotron_h"].config(1000).to_dict()
    with pytest.raises(UnsupportedModelError, match="MoE"):
        config_from_hf(dict(nemotron, hybrid_override_pattern="M*E"))
    granite = BY_NAME["granitehybrid"].config(1000).to_dict()
    assert config_from_hf(granite).architecture == "granitehybrid"
    with pytest.raises(UnsupportedModelError, match="RoPE"):
        config_from_hf(dict(granite, position_embedding_type="rope"))


def test_preemption_recomputes_the_states(llm: LLM) -> None:
    """A budget of a few blocks (4 slots in half of it, the rest fewer blocks than the 4 sequences need once they
    decode): sequences are preempted (their slots given back) and recomputed to the same outputs."""
    budget = 8 * llm.engine.states.budget.bytes_per_slot
    small = LLM.from_model(llm.lm, kv_cache_gb=budget / 2**30, max_num_seqs=4, enable_prefix_caching=False)
    assert small.engine.states.budget.seats == 4
    blocks = small.engine.stats().kv_blocks_total
    # prompts that fill all but one block between them, each 2 tokens short of a block boundary
    sizes = [(blocks - 1) // 4 + (1 if i < (blocks - 1) % 4 else 0) for i in range(4)]
    ps = prompts(*[16 * b - 2 for b in sizes], seed=31)
    alone = [ids(llm.generate([p], GREEDY))[0] for p in ps]
    assert ids(small.generate(ps, GREEDY)) == alone
    assert small.engine.stats().num_preemptions > 0
    assert_empty(small)


def test_q8_0_gguf_serves_batched_like_alone(checkpoint) -> None:
    """llama.cpp's Q8_0 conversion at the default dtype (the matrices, and Granite 4 H's experts with the shared
    MLP, on the native block kernels where built): outputs are the same batched or alone."""
    from converter_parity import convert, load_ours

    folder = checkpoint[1]
    lm = load_ours(convert(folder, folder.parent / f"{checkpoint[2]}.q8_0.gguf", outtype="q8_0"), dtype="auto")
    assert lm.config.architecture == BY_NAME[checkpoint[2]].arch
    from edgeserve.kernels import cpu_native

    if lm.config.is_moe and cpu_native.available():  # experts and the shared MLP in the one-call MoE layer
        moe = lm.model.layers[0].moe
        assert moe.native() is not None and moe.shared is not None and lm.model.layers[0].gate_up is None
    served = LLM.from_model(lm, kv_cache_gb=0.01, enable_prefix_caching=False)
    ps = prompts(7, 19, 33, seed=41)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert ids(served.generate(ps, params)) == [ids(served.generate([p], params))[0] for p in ps]
    assert_empty(served)
