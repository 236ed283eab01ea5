"""The one-step overlap (`overlap="on"`): launching step N+1 before step N's ids reach the host changes no output
(greedy, seeded sampling, logprobs, stop ids, max_tokens, preemption, prefix caching, aborts, penalties), and
placeholders never reach the sampler, the prefix cache or a caller. On CPU the launch is synchronous, so this
checks the bookkeeping; the GPU test at the end checks that the launch path does not wait for the device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edgeserve.engine import core as engine_core
from edgeserve.engine.runner import model_runner
from edgeserve.engine.config import EngineConfig
from edgeserve.engine.core import PLACEHOLDER
from edgeserve.llm import LLM
from edgeserve.sampling_params import SamplingParams

TINY = Path(__file__).resolve().parents[3] / "benchmarks" / "configs" / "tiny-llama.json"


@pytest.fixture(scope="module")
def tiny():
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    return load_model(resolve(str(TINY)), dtype="float32", device="cpu", load_format="dummy")


def _prompts(n: int) -> list[list[int]]:
    return [[(11 * i + 7 * j) % 300 for j in range(2 + 9 * i)] for i in range(n)]


def _run(llm: LLM, prompts, params):
    """Token ids, finish reasons, stop reasons and logprobs of each result."""
    results = llm.generate(prompts, params)
    return [(r.outputs[0].token_ids, r.outputs[0].finish_reason, r.outputs[0].stop_reason, r.outputs[0].logprobs)
            for r in results]


def _assert_clean(llm: LLM) -> None:
    bm = llm.engine.scheduler.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks
    assert not llm.engine.has_work() and llm.engine._inflight is None


@pytest.fixture
def fills(monkeypatch):
    """Counts the device-side token fills (each one is a step launched before the previous one landed)."""
    calls = []
    original = model_runner.TokenFill.apply

    def apply(self, tokens):
        calls.append(len(self.index))
        return original(self, tokens)

    monkeypatch.setattr(model_runner.TokenFill, "apply", apply)
    return calls


def test_overlap_setting():
    with pytest.raises(ValueError, match="overlap must be"):
        EngineConfig(overlap="yes")
    assert EngineConfig().overlap == "auto"


def test_auto_is_off_on_cpu_and_on_turns_it_on(tiny):
    assert not LLM.from_model(tiny, kv_cache_gb=0.01).engine.overlap
    assert LLM.from_model(tiny, kv_cache_gb=0.01, overlap="on").engine.overlap
    assert not LLM.from_model(tiny, kv_cache_gb=0.01, overlap="off").engine.overlap


def test_default_model_outputs_equal_without_overlap(default_model, fills):
    """Greedy, seeded sampling with logprobs, a stop token id, max_tokens 1 and a chat prompt that ends by itself,
    batched together: token for token what the engine gives without overlap."""
    tok, tmpl = default_model.tokenizer, default_model.chat_template
    chat = tok.encode(tmpl.render([{"role": "user", "content": "Say hi."}]), add_special_tokens=False)
    count = tok.encode("1, 2, 3, 4,")
    story = tok.encode("Once upon a time")
    off = LLM.from_model(default_model, kv_cache_gb=0.05, overlap="off")
    free = off.generate([count], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].token_ids
    prompts = [chat, count, story, count, story]
    params = [SamplingParams(temperature=0, max_tokens=64),
              SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[free[2]]),
              SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10, logprobs=2),
              SamplingParams(temperature=0, max_tokens=1),
              SamplingParams(temperature=0, max_tokens=9, logprobs=0)]
    before = off.engine.stats().generation_tokens
    expected = _run(off, prompts, params)
    on = LLM.from_model(default_model, kv_cache_gb=0.05, overlap="on")
    got = _run(on, prompts, params)
    assert got == expected
    assert expected[0][1] == "stop" and len(expected[0][0]) < 64  # the chat reply ended on its own
    assert expected[1][1] == "stop" and expected[1][0] == free[:free.index(free[2]) + 1]
    assert [len(e[0]) for e in expected[2:]] == [10, 1, 9]
    assert sum(fills) > 0
    assert all(t != PLACEHOLDER for e in got for t in e[0])
    assert on.engine.stats().generation_tokens == off.engine.stats().generation_tokens - before
    _assert_clean(on)


def test_preemption_under_memory_pressure(tiny, fills):
    prompts = _prompts(6)
    params = SamplingParams(temperature=0, max_tokens=20)
    expected = _run(LLM.from_model(tiny, kv_cache_gb=0.01, overlap="off"), prompts, params)
    block_bytes = 2 * 2 * 2 * 16 * 4 * 16  # K and V, 2 layers, 2 KV heads of 16, float32, 16 tokens
    longest = max(len(p) for p in prompts) + params.max_tokens
    tight = LLM.from_model(tiny, kv_cache_gb=(longest // 16 + 3) * block_bytes / 2**30, overlap="on")
    assert tight.engine.scheduler.block_manager.num_blocks < sum(len(p) + 20 for p in prompts) // 16
    got = _run(tight, prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert sum(fills) > 0
    _assert_clean(tight)


def test_prefix_cache_sees_real_tokens(tiny):
    """The second turn (prompt + first reply + more) reuses as many cached tokens as without overlap: the reply's
    blocks were hashed with the real ids, not placeholders."""
    first = _prompts(3)[2]
    reused = {}
    for mode in ("off", "on"):
        llm = LLM.from_model(tiny, kv_cache_gb=0.01, overlap=mode)
        reply = llm.generate([first], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0].token_ids
        second = llm.generate([first + reply + [5, 6, 7]], SamplingParams(temperature=0, max_tokens=8))[0]
        reused[mode] = (second.num_cached_tokens, second.outputs[0].token_ids)
        llm.engine.scheduler.block_manager.check_integrity()
    assert reused["on"] == reused["off"]
    assert reused["on"][0] >= (len(first) + 40) // 16 * 16 - 16  # blocks of the reply were found


def test_penalized_requests_never_sample_from_placeholders(tiny, monkeypatch):
    seen = []
    original = engine_core.sample_rows

    def sample_rows(logits, rows):
        seen.extend(PLACEHOLDER in r.output_ids for r in rows if r.params.penalized)
        return original(logits, rows)

    monkeypatch.setattr(engine_core, "sample_rows", sample_rows)
    prompts = _prompts(4)
    params = [SamplingParams(temperature=0, max_tokens=12),
              SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, frequency_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=6), SamplingParams(temperature=0, max_tokens=12)]
    expected = _run(LLM.from_model(tiny, kv_cache_gb=0.01, overlap="off"), prompts, params)
    on = LLM.from_model(tiny, kv_cache_gb=0.01, overlap="on")
    seen.clear()
    assert _run(on, prompts, params) == expected
    assert seen and not any(seen)
    _assert_clean(on)


def test_abort_mid_stream_frees_everything(tiny, fills):
    llm = LLM.from_model(tiny, kv_cache_gb=0.01, overlap="on")
    off = LLM.from_model(tiny, kv_cache_gb=0.01, overlap="off")
    prompt = _prompts(3)[1]
    params = SamplingParams(temperature=0, max_tokens=50)
    whole = off.generate([prompt], params)[0].outputs[0].token_ids
    got = []
    for delta in llm.stream(prompt, params):
        got += delta.token_ids
        if len(got) >= 5:
            break  # closing the generator aborts the request
    assert got[:5] == whole[:5] and PLACEHOLDER not in got
    _assert_clean(llm)
    assert sum(fills) > 0
    # the engine goes on serving after the abort
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == whole


def test_static_buffer_decode_path_fills_from_the_device(tiny, fills):
    """The CUDA-graph bookkeeping (run eagerly, capture off) takes placeholder ids from the device too."""
    from edgeserve.engine.runner.cuda_graphs import DecodeGraphs
    from edgeserve.engine.cache.kv_cache import KVPool

    prompts = _prompts(5)
    params = SamplingParams(temperature=0, max_tokens=8)
    expected = _run(LLM.from_model(tiny, kv_cache_gb=0.01, max_num_seqs=8), prompts, params)
    graphed = LLM.from_model(tiny, kv_cache_gb=0.01, max_num_seqs=8, overlap="on")
    core = graphed.engine
    core.pool = KVPool(tiny.config, core.pool.num_blocks, core.pool.block_size, tiny.model.dtype, "cpu",
                       scratch_block=True)
    core.runner.pool = core.pool
    core.runner.graphs = DecodeGraphs(tiny.model, core.pool, 8, core.max_model_len, capture=False)
    assert _run(graphed, prompts, params) == expected
    assert core.runner.graphs.eager_runs >= 6 and sum(fills) >= 6 * 5


@pytest.mark.gpu
def test_cuda_launch_does_not_wait_for_the_device(default_model_path):
    """On a GPU, launching a step (building its inputs, the forward, sampling, the copy of its ids) makes no
    synchronizing call, and overlap on gives the tokens of overlap off."""
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    lm = load_model(resolve(str(default_model_path)), device="cuda")
    tok = lm.tokenizer
    prompts = [tok.encode("The capital of France is"), tok.encode("1, 2, 3,"), tok.encode("Once upon a time")]
    params = SamplingParams(temperature=0, max_tokens=16)
    expected = _run(LLM.from_model(lm, overlap="off"), prompts, params)
    llm = LLM.from_model(lm, overlap="on")
    assert _run(llm, prompts, params) == expected
    core = llm.engine
    for p in prompts:
        core.add_request(p, params)
    core.step()  # prefill
    core.step()  # first decode, launched before the prefill's ids landed
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        assert core._inflight is not None
        launched = core._launch()  # schedule, inputs, forward (ids filled from the device), sample, copy started
        assert launched.copy is not None
    finally:
        torch.cuda.set_sync_debug_mode("default")
