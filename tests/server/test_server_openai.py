"""The openai SDK (sync and async, streaming and not) against `edgeserve serve` on the real default model."""

from __future__ import annotations

import json
import socket
import threading
import time

import anyio
import httpx
import openai
import pytest

from edgeserve.registry import DEFAULT_MODEL
from edgeserve.server import ServerConfig
from edgeserve.engine.config import EngineConfig
from server_helpers import concurrent_replies, metric, serve, wait_until

pytestmark = pytest.mark.slow
MSG = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(default_model_path):
    """One server on the default model; the first request's lazy load is watched through /api/ps and /health."""
    with serve(ServerConfig(engine=EngineConfig(max_num_seqs=16, kv_cache_gb=0.25),
                            models=(DEFAULT_MODEL,), keep_alive=None)) as s:
        seen: dict = {"ps_before": None, "states": set(), "health_loading": False, "status": None}
        with httpx.Client(base_url=s.url, timeout=120) as c:
            seen["ps_before"] = c.get("/api/ps").json()["models"]

            def first() -> None:
                seen["status"] = c.post("/v1/chat/completions", json={"model": DEFAULT_MODEL, "messages": MSG,
                                                                      "max_tokens": 2}).status_code

            t = threading.Thread(target=first)
            t.start()
            while t.is_alive():
                seen["states"] |= {m["status"] for m in c.get("/api/ps").json()["models"]}
                seen["health_loading"] |= c.get("/health").json()["loading"]
                time.sleep(0.05)
            t.join()
        s.first_load = seen
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def lm(server):
    return server.manager.entries[DEFAULT_MODEL].lm


def test_first_request_loads_the_model_lazily(server):
    seen = server.first_load
    assert seen["ps_before"] == []
    assert "loading" in seen["states"] and seen["health_loading"]
    assert seen["status"] == 200


def test_models_list(client):
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == DEFAULT_MODEL


def test_chat_usage_matches_the_tokenizer(client, lm):
    r = client.chat.completions.create(model=DEFAULT_MODEL, messages=MSG, max_tokens=6, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    prompt_ids = lm.tokenizer.encode(lm.chat_template.render(MSG, add_generation_prompt=True),
                                     add_special_tokens=False)
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert 1 <= r.usage.completion_tokens <= 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert (choice.finish_reason == "length") == (r.usage.completion_tokens == 6)
    if choice.finish_reason == "length":  # the text is the decoded tokens (re-encoding may merge or split one)
        assert len(lm.tokenizer.encode(choice.message.content, add_special_tokens=False)) in range(4, 9)
    # the same conversation again reuses the prompt's cached blocks
    again = client.chat.completions.create(model=DEFAULT_MODEL, messages=MSG, max_tokens=6, temperature=0)
    assert again.choices[0].message.content == choice.message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_stream_equals_non_stream(client):
    full = client.chat.completions.create(model=DEFAULT_MODEL, messages=MSG, max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(model=DEFAULT_MODEL, messages=MSG, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) >= 3  # one event per delta
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completions_sync_and_stream(client):
    r = client.completions.create(model=DEFAULT_MODEL, prompt="The capital of France is", max_tokens=6,
                                  temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=DEFAULT_MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, stream=True))
    assert streamed == r.choices[0].text
    two = client.completions.create(model=DEFAULT_MODEL, prompt=["One, two,", "A, B,"], max_tokens=3, temperature=0)
    assert [c.index for c in two.choices] == [0, 1] and two.choices[0].text != two.choices[1].text


def test_stop_strings(client):
    base = client.chat.completions.create(model=DEFAULT_MODEL, messages=MSG, max_tokens=24, temperature=0)
    text = base.choices[0].message.content
    words = text.split()
    assert len(words) >= 3, text
    stop = " " + words[2]
    r = client.chat.completions.create(model=DEFAULT_MODEL, messages=MSG, max_tokens=24, temperature=0,
                                       stop=[stop, "zzzz"])
    assert r.choices[0].message.content == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    s = client.chat.completions.create(model=DEFAULT_MODEL, messages=MSG, max_tokens=24, temperature=0, stop=stop,
                                       stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in s) == text[: text.index(stop)]


def test_seed_reproducible_and_n(client):
    kw = dict(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=6,
              temperature=1.0, top_p=0.95, seed=1234)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    n = client.chat.completions.create(**kw, n=3)
    assert [c.index for c in n.choices] == [0, 1, 2]
    assert n.choices[0].message.content == a.choices[0].message.content  # choice i uses seed + i
    assert len({c.message.content for c in n.choices}) > 1
    assert n.usage.completion_tokens >= a.usage.completion_tokens + 2  # every choice's tokens count
    assert n.usage.prompt_tokens == a.usage.prompt_tokens  # the prompt counts once


def test_logprobs_shape(client, lm):
    r = client.chat.completions.create(model=DEFAULT_MODEL, messages=MSG, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for tok in content:
        assert tok.logprob <= 0 and len(tok.top_logprobs) == 3
        tops = [t.logprob for t in tok.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert tok.token == tok.top_logprobs[0].token  # greedy picks the best
    c = client.completions.create(model=DEFAULT_MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(len(t) <= 2 for t in lp.top_logprobs) and "".join(lp.tokens) == c.choices[0].text


def test_async_client(server):
    async def main() -> tuple[str, str]:
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        r = await ac.chat.completions.create(model=DEFAULT_MODEL, messages=MSG, max_tokens=4, temperature=0)
        parts = []
        async for chunk in await ac.chat.completions.create(model=DEFAULT_MODEL, messages=MSG, max_tokens=4,
                                                            temperature=0, stream=True):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
        await ac.close()
        return r.choices[0].message.content, "".join(parts)

    full, streamed = anyio.run(main)
    assert full and full == streamed


def test_sixteen_concurrent_streams_match_solo(server, client):
    """Greedy text is the same whether a request runs alone or batched with 15 others (continuous batching)."""
    prompts = [f"{i}, {i + 1}, {i + 2}," for i in range(16)]
    kw = dict(model=DEFAULT_MODEL, max_tokens=6, temperature=0)
    solo = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]

    async def streamed(client, i: int) -> str:
        text = ""
        async for chunk in await client.completions.create(prompt=prompts[i], stream=True, **kw):
            text += chunk.choices[0].text
        return text

    together = concurrent_replies(server, 16, streamed)
    assert len(set(solo)) > 1  # the prompts really differ
    assert together == solo


def first_data(lines) -> str:
    """The first SSE line that is not blank or a `: ping` comment (pings come while a slow machine prefills)."""
    return next(line for line in lines if line and not line.startswith(":"))


def test_long_request_does_not_block_a_short_one(server, client):
    engine = server.manager.entries[DEFAULT_MODEL].engine
    with httpx.Client(base_url=server.url, timeout=60) as c:
        # far more tokens than any device makes while the short one runs: the long one is still going after it
        body = {"model": DEFAULT_MODEL, "prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True,
                "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as long:
            lines = long.iter_lines()  # keep a reference: a collected iterator closes the response
            assert first_data(lines).startswith("data:")  # the long one is generating
            short = client.completions.create(model=DEFAULT_MODEL, prompt="Hi", max_tokens=2, temperature=0)
            assert short.usage.completion_tokens == 2
            # the short request finished while the long one is still running (batched, not queued behind it)
            assert engine.stats().num_running == 1
    assert wait_until(lambda: engine.stats().num_running == 0, 30)  # closing the long stream cancels it


def test_client_disconnect_frees_blocks(server):
    engine = server.manager.entries[DEFAULT_MODEL].engine
    generated_before = engine.stats().generation_tokens
    with httpx.Client(base_url=server.url, timeout=60) as c:
        body = {"model": DEFAULT_MODEL, "messages": MSG, "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            assert first_data(lines).startswith("data:")
            # the engine's stats are as of its last finished step: wait until they show the request
            assert wait_until(lambda: engine.stats().num_running == 1 and engine.stats().kv_blocks_used > 0, 60)
        # the response is closed mid-stream: the request is aborted and its blocks freed
        assert wait_until(lambda: engine.stats().kv_blocks_used == 0 and engine.stats().num_running == 0, 60)
        stats = engine.stats()
        assert stats.generation_tokens - generated_before < 4000  # cancelled, not run to max_tokens
        text = c.get("/metrics").text
        assert metric(text, "edgeserve_kv_blocks_used", f'model="{DEFAULT_MODEL}"') == 0
        assert metric(text, "edgeserve_num_requests_running", f'model="{DEFAULT_MODEL}"') == 0


def test_client_gone_cancels_a_non_streamed_request(server):
    engine = server.manager.entries[DEFAULT_MODEL].engine
    generated_before = engine.stats().generation_tokens
    body = json.dumps({"model": DEFAULT_MODEL, "messages": MSG, "max_tokens": 4000, "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:  # a client that gives up mid-request
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert wait_until(lambda: engine.stats().generation_tokens > generated_before, 60)  # it is generating
    assert wait_until(lambda: engine.stats().num_running == 0 and engine.stats().kv_blocks_used == 0, 60)
    assert engine.stats().generation_tokens - generated_before < 4000


def test_metrics_exposed(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        text = c.get("/metrics").text
    for name in ("edgeserve_time_to_first_token_seconds_count", "edgeserve_time_per_output_token_seconds_count",
                 "edgeserve_e2e_request_latency_seconds_count", "edgeserve_prompt_tokens_total",
                 "edgeserve_cached_prompt_tokens_total", "edgeserve_generation_tokens_total",
                 "edgeserve_kv_blocks_total", "edgeserve_num_requests_waiting", "edgeserve_preemptions_total",
                 "edgeserve_model_load_seconds_count", "edgeserve_spec_acceptance_rate"):
        assert metric(text, name, f'model="{DEFAULT_MODEL}"') is not None, name
    assert metric(text, "edgeserve_time_to_first_token_seconds_count", f'model="{DEFAULT_MODEL}"') >= 5
    assert metric(text, "edgeserve_kv_blocks_total", f'model="{DEFAULT_MODEL}"') > 0
    assert metric(text, "edgeserve_http_requests_total", 'path="/v1/chat/completions",status="200"') >= 5
