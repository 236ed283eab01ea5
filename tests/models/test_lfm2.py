"""LFM2 and LFM3 (gated short-conv layers beside attention; LFM3's sliding-window and global layers; each
module-fixture test runs for both) through the engine: each conv layer's state lives in a seat of the state pool (the
`short_conv` kind, [K - 1, hidden] per layer) beside the paged KV of the attention layers; greedy outputs equal
transformers' greedy generate, batched or alone, chunked or whole; a prefix-cache hit resumes from a conv-state
snapshot; speculation rolls the conv state back; preemption recomputes or swaps it. LFM2-MoE (`lfm2moe`) serves like
transformers too. Logit parity of the GGUF and HF folder: test_registered_architectures' `lfm2`, `lfm2moe` and
`lfm3` cases."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hybrid_helpers import (GREEDY, assert_empty, check_greedy_equals_transformers,  # noqa: E402
                            check_second_turn_resumes, check_speculation_rolls_back, hf_greedy, ids, make_checkpoint,
                            prompts)

from edgeserve.llm import LLM  # noqa: E402
from edgeserve.sampling_params import SamplingParams  # noqa: E402


# per architecture: (conv layers, conv kernel, attention layers) of its converter case, and each layer's cache
SHAPES = {"lfm2": (3, 3, 2), "lfm3": (4, 7, 3)}
CACHES = {"lfm2": ["none", "none", "full", "none", "full"],
          "lfm3": ["none", "none", "full", "none", "window", "none", "full"]}  # window: 5 tokens


@pytest.fixture(scope="module", params=list(SHAPES))
def checkpoint(request, default_model_path, tmp_path_factory):
    return make_checkpoint(request.param, default_model_path, tmp_path_factory)


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(str(checkpoint[1]), dtype="float32", device="cpu", kv_cache_gb=0.01, enable_prefix_caching=False)


def test_state_pool_holds_short_conv_states(llm: LLM) -> None:
    from edgeserve.engine.cache.cache_spec import layer_caches

    engine, c = llm.engine, llm.lm.config
    conv, kernel, attention = SHAPES[c.architecture]
    spec = engine.states.pool.spec
    assert spec.kind.name == "short_conv" and spec.num_layers == conv == c.num_linear_layers
    assert spec.bytes_per_sequence == conv * (kernel - 1) * 64 * 4  # conv layers x (K - 1) x hidden x float32
    assert engine.pool.k.shape[0] + engine.pool.window_k.shape[0] == attention  # only they keep K/V
    caches = layer_caches(c)
    assert [x.kind for x in caches] == CACHES[c.architecture]
    assert all((x.state is not None) == (x.kind == "none") for x in caches)  # the conv layers keep a state
    assert {x.window for x in caches if x.kind == "window"} <= {5}


def test_greedy_equals_transformers_batched_or_alone(checkpoint, llm: LLM) -> None:
    check_greedy_equals_transformers(checkpoint[0], llm)


def test_second_turn_resumes_from_a_conv_state_snapshot(llm: LLM) -> None:
    check_second_turn_resumes(llm)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_speculation_rolls_the_conv_state_back(llm: LLM, prefix_caching: bool) -> None:
    check_speculation_rolls_back(llm, prefix_caching)


def test_lfm2_moe_greedy_equals_transformers_batched_or_alone(default_model_path, tmp_path_factory) -> None:
    """LFM2-MoE: expert layers (sigmoid router, expert bias) after the dense ones, conv states in the pool."""
    model, folder = make_checkpoint("lfm2moe", default_model_path, tmp_path_factory)
    llm = LLM(str(folder), dtype="float32", device="cpu", kv_cache_gb=0.01, enable_prefix_caching=False)
    assert llm.lm.config.architecture == "lfm2moe" and llm.engine.states.pool.spec.kind.name == "short_conv"
    assert [layer.moe is not None for layer in llm.lm.model.layers] == [False, False, True, True, True]
    ps = prompts(6, 27, 50, seed=11)
    reference = [hf_greedy(model, p, 10) for p in ps]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    assert ids(llm.generate(ps, params)) == reference
    assert [ids(llm.generate([p], params))[0] for p in ps] == reference
    assert_empty(llm)


def test_a_conversation_resumes_after_a_restart_from_the_disk_tier(checkpoint, llm: LLM, tmp_path) -> None:
    """LFM2's conv-state snapshots go to the disk tier beside their blocks (as `short_conv` records) and come back
    after a restart: the next turn computes only its new tokens, with the cold run's output."""
    from edgeserve.offload.disk_tier import STATE_SUFFIX

    def served() -> LLM:
        return LLM(str(checkpoint[1]), dtype="float32", device="cpu", kv_cache_gb=0.01, kv_offload="cpu,disk",
                   disk_kv_path=str(tmp_path))

    first = prompts(45, seed=21)[0]
    a = served()
    reply = ids(a.generate([first], GREEDY))[0]
    assert reply == ids(llm.generate([first], GREEDY))[0]
    a.close()
    assert len(list(tmp_path.rglob(f"*{STATE_SUFFIX}"))) == 2  # the prompt's and the latest snapshot
    second = first + reply + prompts(9, seed=22)[0]
    b = served()
    before = b.engine.stats()
    out = ids(b.generate([second], GREEDY))[0]
    after = b.engine.stats()
    assert after.prompt_tokens_from_states - before.prompt_tokens_from_states == 48
    assert after.prompt_tokens_computed - before.prompt_tokens_computed == len(second) - 48
    assert out == ids(llm.generate([second], GREEDY))[0]
    assert after.offload.state_disk_hits == 1
    b.close()


def test_preemption_recomputes_the_conv_state(llm: LLM) -> None:
    """A budget of a few blocks: sequences are preempted (their seats given back) and recomputed to the same
    outputs; with the host tier, swapped out and back instead (every prompt token computed once)."""
    from edgeserve.engine.cache.kv_cache import kv_bytes_per_token

    ps = prompts(20, 26, 31, 17, seed=31)
    alone = [ids(llm.generate([p], GREEDY))[0] for p in ps]
    per = llm.engine.states.budget.bytes_per_slot
    # 4 seats, 7 blocks of every layer's K/V
    budget = 8 * per + 7 * kv_bytes_per_token(llm.lm.config, llm.lm.model.dtype) * 16
    small = LLM.from_model(llm.lm, kv_cache_gb=budget / 2**30, max_num_seqs=4, enable_prefix_caching=False)
    assert ids(small.generate(ps, GREEDY)) == alone
    assert small.engine.stats().num_preemptions > 0
    assert_empty(small)
    swapping = LLM.from_model(llm.lm, kv_cache_gb=budget / 2**30, max_num_seqs=4, enable_prefix_caching=False,
                              kv_offload="cpu", cpu_kv_gb=0.01)
    assert ids(swapping.generate(ps, GREEDY)) == alone
    stats = swapping.engine.stats()
    assert stats.offload.swap_outs > 0 and stats.offload.swap_ins == stats.offload.swap_outs
    assert stats.prompt_tokens_computed == sum(len(p) for p in ps)


def test_lfm2_moe_q8_0_gguf_runs_its_experts_natively(default_model_path, tmp_path_factory) -> None:
    """llama.cpp's Q8_0 conversion served at the default dtype: the experts stay in block format on the one-call
    native MoE layer (taking LFM2-MoE's own routing), and outputs are the same batched or alone."""
    from converter_parity import convert, load_ours

    from edgeserve.kernels.cpu import native as cpu_native

    if not cpu_native.available():
        pytest.skip("the native CPU kernels are not built here")
    _, folder = make_checkpoint("lfm2moe", default_model_path, tmp_path_factory)
    lm = load_ours(convert(folder, folder.parent / "lfm2moe.q8_0.gguf", outtype="q8_0"), dtype="auto")
    assert lm.model.dtype == torch.bfloat16 and lm.model.layers[2].moe.native() is not None
    assert lm.model.native_decoder() is not None  # its router is moe_layer.c's ROUTE_SIGMOID_BIAS: fused
    llm = LLM.from_model(lm, kv_cache_gb=0.01, enable_prefix_caching=False)
    ps = prompts(7, 19, 33, seed=41)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert ids(llm.generate(ps, params)) == [ids(llm.generate([p], params))[0] for p in ps]
    assert_empty(llm)



def test_lfm3_q8_0_gguf_serves_batched_as_alone(default_model_path, tmp_path_factory) -> None:
    """Our lfm3 GGUF in Q8_0 (support.gguf_writer) served at the default dtype: the matrices (the gate's rows
    stacked after q, k, v) stay in block format on the native kernels, the fused stack runs them
    (test_lfm2_fused), and outputs are the same batched or alone."""
    from converter_parity import load_ours
    from support.gguf_writer import write_model_gguf

    from edgeserve.kernels.cpu import native as cpu_native

    if not cpu_native.available():
        pytest.skip("the native CPU kernels are not built here")
    model, folder = make_checkpoint("lfm3", default_model_path, tmp_path_factory)
    lm = load_ours(write_model_gguf(model, folder.parent / "lfm3.q8_0.gguf", "lfm3", qtype="Q8_0"), dtype="auto")
    attention = lm.model.layers[2]
    assert lm.model.dtype == torch.bfloat16 and attention.gated and not isinstance(attention.qkv, torch.Tensor)
    assert lm.model.native_decoder() is not None  # the fused stack (models.archs.lfm3.native_plan)
    llm = LLM.from_model(lm, kv_cache_gb=0.01, enable_prefix_caching=False)
    ps = prompts(7, 19, 33, seed=41)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert ids(llm.generate(ps, params)) == [ids(llm.generate([p], params))[0] for p in ps]
    assert_empty(llm)
