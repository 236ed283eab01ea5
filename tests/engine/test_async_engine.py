"""AsyncEngine on anyio: streamed deltas, concurrency, cancellation and shutdown, on the real default model."""

from __future__ import annotations

import anyio
import pytest

from edgeserve.engine.async_engine import AsyncEngine
from edgeserve.engine.config import EngineConfig
from edgeserve.errors import EngineError, QueueFullError
from edgeserve.llm import LLM
from edgeserve.sampling_params import SamplingParams


def chat_ids(lm, text: str) -> list[int]:
    return lm.tokenizer.encode(lm.chat_template.render([{"role": "user", "content": text}]), add_special_tokens=False)


async def collect(stream) -> tuple[str, list[int], list]:
    text, ids, deltas = "", [], []
    async for d in stream:
        text += d.text
        ids += d.token_ids
        deltas.append(d)
    return text, ids, deltas


async def until_idle(engine: AsyncEngine, timeout: float = 60.0) -> None:
    """Wait until the engine has no request and no KV block in use (an abort is handled at its next step)."""
    with anyio.fail_after(timeout):
        while engine.num_unfinished or engine.stats().kv_blocks_used:
            await anyio.sleep(0.01)


def run_with_engine(lm, config: EngineConfig, body):
    """Run `body(engine)` with the engine's loop running beside it; shut down afterwards."""
    result = {}

    async def main():
        engine = AsyncEngine(lm, config)
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            try:
                result["value"] = await body(engine)
            finally:
                engine.shutdown()
        assert not engine.running

    anyio.run(main)
    return result["value"]


def test_concurrent_streams_match_the_batch_api(default_model):
    lm = default_model
    questions = ["Count to five.", "Name a color.", "What is 2+2?", "Say hello in French."]
    llm = LLM.from_model(lm, kv_cache_gb=0.05)
    free_text = llm.generate([chat_ids(lm, questions[0])], SamplingParams(temperature=0, max_tokens=20))[0].text
    stop = free_text[8:11]  # a stop string in the middle of what it would say
    params = [SamplingParams(temperature=0, max_tokens=20, stop=[stop] if i == 0 else [], logprobs=2 if i == 1 else None)
              for i in range(4)]
    expected = llm.generate([chat_ids(lm, q) for q in questions], params)

    async def body(engine):
        got = [None] * 4

        async def one(i):
            got[i] = await collect(engine.generate(chat_ids(lm, questions[i]), params[i]))

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(one, i)
        return got, engine.stats()

    got, stats = run_with_engine(lm, EngineConfig(kv_cache_gb=0.05), body)
    for (text, ids, deltas), exp in zip(got, expected):
        assert text == exp.text and ids == exp.outputs[0].token_ids
        last = deltas[-1]
        assert last.finish_reason == exp.outputs[0].finish_reason and all(d.finish_reason is None for d in deltas[:-1])
        assert last.num_output_tokens == len(ids) and last.num_prompt_tokens == len(exp.prompt_token_ids)
    assert got[0][2][-1].stop_reason == stop and got[0][0] == free_text[: free_text.index(stop)]
    assert all(len(d.logprobs) == len(d.token_ids) for d in got[1][2])
    assert stats.kv_blocks_used == 0 and stats.num_running == 0


def test_cancelling_the_consumer_frees_every_block(default_model):
    lm = default_model

    async def body(engine):
        seen = 0
        stream = engine.generate(chat_ids(lm, "Write a very long story."), SamplingParams(temperature=0, max_tokens=400))
        with anyio.move_on_after(60):
            async for d in stream:
                seen += len(d.token_ids)
                if seen >= 5:
                    running = engine.stats()
                    break
        await stream.aclose()
        assert running.kv_blocks_used > 0
        await until_idle(engine)  # the abort lands at the start of the next step
        return engine.stats()

    stats = run_with_engine(lm, EngineConfig(kv_cache_gb=0.05), body)
    assert stats.kv_blocks_used == 0 and stats.num_running == 0


def test_task_cancellation_aborts_the_request(default_model):
    lm = default_model

    async def body(engine):
        seen = 0
        with anyio.CancelScope() as scope:  # cancelled mid-generation: after 5 tokens, whatever the device's speed
            async for d in engine.generate([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)):
                seen += len(d.token_ids)
                if seen >= 5:
                    scope.cancel()
                    await anyio.sleep(0)  # the cancellation is delivered at this checkpoint, inside the stream
        assert 5 <= seen < 300
        await until_idle(engine)
        return True

    assert run_with_engine(lm, EngineConfig(kv_cache_gb=0.05), body)


def test_shutdown_ends_running_requests_with_abort(default_model):
    lm = default_model

    async def body(engine):
        stream = engine.submit([1, 2, 3], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
        first = await stream.__anext__()
        engine.shutdown()
        rest = [d async for d in stream]
        return first, rest

    first, rest = run_with_engine(lm, EngineConfig(kv_cache_gb=0.05), body)
    assert first.finish_reason is None
    assert rest and rest[-1].finish_reason == "abort"


def test_queue_full_is_refused_at_submit(default_model):
    lm = default_model

    async def body(engine):
        engine.submit([1, 2], SamplingParams(max_tokens=4))
        with pytest.raises(QueueFullError):
            engine.submit([1, 2], SamplingParams(max_tokens=4))
        return True

    assert run_with_engine(lm, EngineConfig(kv_cache_gb=0.05, max_waiting=1), body)


def test_a_failing_step_ends_requests_with_an_error_and_the_engine_lives_on(default_model):
    lm = default_model

    async def body(engine):
        real_step = engine.core.runner.execute
        engine.core.runner.execute = lambda *a: (_ for _ in ()).throw(RuntimeError("boom"))
        with pytest.raises(EngineError, match="engine failed: RuntimeError"):  # the type, no internals
            await collect(engine.generate([1, 2, 3], SamplingParams(max_tokens=4)))
        engine.core.runner.execute = real_step
        text, ids, _ = await collect(engine.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
        return ids, engine.stats()

    ids, stats = run_with_engine(lm, EngineConfig(kv_cache_gb=0.05), body)
    assert len(ids) == 4 and stats.kv_blocks_used == 0


def test_a_stop_string_ends_its_request_before_the_next_step(default_model):
    """The step that produces a stop string's last token also ends the request: no decode row or step is spent on
    it afterwards (the generated-token and step counters equal the tokens the client got)."""
    lm = default_model
    prompt = chat_ids(lm, "Count to five.")
    free = LLM.from_model(lm, kv_cache_gb=0.05).generate([prompt], SamplingParams(temperature=0, max_tokens=24))[0]
    stop = free.text[8:11]
    params = SamplingParams(temperature=0, max_tokens=24, stop=[stop])

    async def body(engine):
        text, ids, deltas = await collect(engine.generate(prompt, params))
        await until_idle(engine)
        return text, ids, deltas[-1], engine.stats()

    text, ids, last, stats = run_with_engine(lm, EngineConfig(kv_cache_gb=0.05), body)
    assert last.finish_reason == "stop" and last.stop_reason == stop and text == free.text[: free.text.index(stop)]
    assert len(ids) < len(free.outputs[0].token_ids)
    assert stats.generation_tokens == len(ids) == last.num_output_tokens
    assert stats.num_steps == len(ids)  # one prefill step (the first token), then one decode step per token
