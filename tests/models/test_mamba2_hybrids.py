"""The Mamba-2 hybrids through the engine: Nemotron-H (Mamba-2 blocks beside attention and MLP blocks; MoE blocks
in nemotron_h_moe), Granite 4 H (Mamba-2 or attention, then an MLP, in every layer) and Falcon-H1 (attention and
Mamba-2 side by side in every layer). Each Mamba-2 layer's conv and ssm states live in a slot of the state pool (the
`mamba2` kind) beside the paged KV of the attention layers; greedy outputs equal transformers' greedy generate,
batched or alone, chunked or whole; a prefix-cache hit resumes from a state snapshot; speculation rolls the states
back; preemption recomputes them. Logit parity of the GGUF and HF folder: test_registered_architectures'
`nemotron_h`, `nemotron_h_moe`, `granitehybrid` and `falcon-h1` cases."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from converter_cases import BY_NAME  # noqa: E402
from hybrid_helpers import (GREEDY, assert_empty, check_greedy_equals_transformers,  # noqa: E402
                            check_second_turn_resumes, check_speculation_rolls_back, ids, make_checkpoint, prompts)

from edgeserve.llm import LLM  # noqa: E402
from edgeserve.sampling_params import SamplingParams  # noqa: E402


# case: (Mamba-2 layers, attention layers, conv channels H * P + 2 * G * N, ssm H x P x N)
SHAPES = {"nemotron_h": (3, 2, 8 * 16 + 2 * 2 * 16, 8 * 16 * 16),  # "M-*M-M*-": MLP blocks keep nothing
          "nemotron_h_moe": (3, 2, 8 * 16 + 2 * 2 * 16, 8 * 16 * 16),  # "MEM*EME*E": MoE blocks keep nothing
          "granitehybrid": (4, 2, 8 * 16 + 2 * 1 * 16, 8 * 16 * 16),
          "granitehybrid-moe": (4, 2, 8 * 16 + 2 * 1 * 16, 8 * 16 * 16),  # experts beside the MLP
          "falcon-h1": (3, 3, 8 * 16 + 2 * 2 * 16, 8 * 16 * 16)}  # attention beside Mamba-2 in every layer


@pytest.fixture(scope="module", params=list(SHAPES))
def checkpoint(request, default_model_path, tmp_path_factory):
    """(transformers model, HF folder, case name) of a converter-parity case."""
    return (*make_checkpoint(request.param, default_model_path, tmp_path_factory), request.param)


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(str(checkpoint[1]), dtype="float32", device="cpu", kv_cache_gb=0.01, enable_prefix_caching=False)


def test_state_pool_holds_mamba2_states(checkpoint, llm: LLM) -> None:
    engine, c = llm.engine, llm.lm.config
    mamba, attention, channels, ssm = SHAPES[checkpoint[2]]
    spec = engine.states.pool.spec
    assert spec.kind.name == "mamba2" and spec.num_layers == mamba == c.num_linear_layers
    assert spec.bytes_per_sequence == mamba * ((4 - 1) * channels + ssm) * 4  # conv (K - 1) x channels, float32
    assert engine.pool.k.shape[0] == attention  # only the attention layers keep K/V


def test_greedy_equals_transformers_batched_or_alone(checkpoint, llm: LLM) -> None:
    check_greedy_equals_transformers(checkpoint[0], llm)


def test_second_turn_resumes_from_a_state_snapshot(llm: LLM) -> None:
    check_second_turn_resumes(llm)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_speculation_rolls_the_states_back(llm: LLM, prefix_caching: bool) -> None:
    check_speculation_rolls_back(llm, prefix_caching)


def test_unsupported_variants_are_refused_by_name() -> None:
    """The variants not run (Nemotron 3 Super's latent expert projections and group-limited routing, Granite 4 H
    with RoPE) get a clear refusal; a pattern with E blocks is nemotron_h_moe."""
    from edgeserve.errors import UnsupportedModelError
    from edgeserve.models.config import config_from_hf

    moe = BY_NAME["nemotron_h_moe"].config(1000).to_dict()
    assert config_from_hf(moe).architecture == "nemotron_h_moe"
    with pytest.raises(UnsupportedModelError, match="latent"):
        config_from_hf(dict(moe, moe_latent_size=32))
    with pytest.raises(UnsupportedModelError, match="group-limited"):
        config_from_hf(dict(moe, n_group=4, topk_group=2))
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
    from edgeserve.kernels.cpu import native as cpu_native

    if checkpoint[2] == "granitehybrid-moe" and cpu_native.available():  # experts and shared MLP in one call
        moe = lm.model.layers[0].moe
        assert moe.native() is not None and moe.shared is not None and lm.model.layers[0].gate_up is None
    served = LLM.from_model(lm, kv_cache_gb=0.01, enable_prefix_caching=False)
    ps = prompts(7, 19, 33, seed=41)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert ids(served.generate(ps, params)) == [ids(served.generate([p], params))[0] for p in ps]
    assert_empty(served)
