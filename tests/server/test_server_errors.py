"""Every HTTP error case: status and OpenAI-shaped body, then a normal request succeeds on the same server."""

from __future__ import annotations

import dataclasses
import threading

import anyio
import httpx
import pytest

from edgeserve.server import ServerConfig
from edgeserve.engine.config import EngineConfig
from server_helpers import serve, wait_until
from tiny_gguf import write_tiny_llama

CHAT = "/v1/chat/completions"
GOOD = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("srv") / "tiny.gguf")


@pytest.fixture(scope="module")
def server(tiny_path):
    with serve(ServerConfig(engine=EngineConfig(kv_cache_gb=0.01), models=(str(tiny_path),), keep_alive=None,
                            max_body_bytes=64 * 1024)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def assert_ok_after(client: httpx.Client) -> None:
    r = client.post(CHAT, json=GOOD)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] >= 1


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None,
                 contains: str = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    assert contains in err["message"], err
    return err


BAD_BODIES = [
    # (body, param, code, message fragment)
    ({"model": "tiny"}, "messages", None, "messages"),
    ({**GOOD, "messages": []}, "messages", None, "non-empty"),
    ({**GOOD, "messages": "hi"}, "messages", None, ""),
    ({**GOOD, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", None, "robot"),
    ({**GOOD, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].image_url.url", None, "data URL"),
    ({**GOOD, "messages": [{"role": "user", "content": [{"type": "audio", "audio": "x"}]}]},
     "messages[0].content[0]", None, "text part"),
    ({**GOOD, "messages": [{"role": "user", "content": 5}]}, "messages[0].content", None, ""),
    ({**GOOD, "model": 3}, "model", None, ""),
    ({**GOOD, "temperature": "hot"}, "temperature", None, "number"),
    ({**GOOD, "temperature": -1}, "temperature", None, "temperature"),
    ({**GOOD, "top_p": 0}, "top_p", None, "top_p"),
    ({**GOOD, "top_k": 1.5}, "top_k", None, "integer"),
    ({**GOOD, "top_k": -1}, "top_k", None, "top_k"),
    ({**GOOD, "min_p": 2}, "min_p", None, "min_p"),
    ({**GOOD, "presence_penalty": 3}, "presence_penalty", None, ""),
    ({**GOOD, "frequency_penalty": -3}, "frequency_penalty", None, ""),
    ({**GOOD, "repetition_penalty": 0}, "repetition_penalty", None, ""),
    ({**GOOD, "seed": "x"}, "seed", None, ""),
    ({**GOOD, "max_tokens": 0}, "max_tokens", None, ""),
    ({**GOOD, "max_completion_tokens": -5}, "max_completion_tokens", None, ""),
    ({**GOOD, "n": 0}, "n", None, ""),
    ({**GOOD, "n": 1000}, "n", None, ""),
    ({**GOOD, "stop": 5}, "stop", None, ""),
    ({**GOOD, "stop": [""]}, "stop", None, ""),
    ({**GOOD, "logprobs": "yes"}, "logprobs", None, ""),
    ({**GOOD, "top_logprobs": 3}, "top_logprobs", None, "requires logprobs"),
    ({**GOOD, "logprobs": True, "top_logprobs": 99}, "top_logprobs", None, ""),
    ({**GOOD, "stream": "yes"}, "stream", None, ""),
    ({**GOOD, "stream_options": {"include_usage": True}}, "stream_options", None, "stream"),
    ({**GOOD, "response_format": {"type": "xml"}}, "response_format", None, "json_schema"),
    ({**GOOD, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "response_format", None, "unsupported JSON schema feature"),
    ({**GOOD, "tools": [{"type": "function", "function": {}}]}, "tools[0].function.name", None, ""),
    ({**GOOD, "tool_choice": "required"}, "tool_choice", None, "needs tools"),
    ({**GOOD, "messages": [{"role": "user", "content": "hi", "name": 5}]}, "messages[0].name", None, ""),
    ({**GOOD, "logit_bias": {"five": 10}}, "logit_bias", None, "token ids"),
    ({**GOOD, "logit_bias": {"5": 500}}, "logit_bias", None, "-100 to 100"),
    ({**GOOD, "logit_bias": {"5": "up"}}, "logit_bias", None, "numbers"),
    ({**GOOD, "logit_bias": [5]}, "logit_bias", None, "object"),
    ({**GOOD, "logit_bias": {"99999999": 5}}, "logit_bias", None, "token ids must be in"),
    ({**GOOD, "frobnicate": 1}, "frobnicate", "unsupported_parameter", "frobnicate"),
]


@pytest.mark.parametrize("body,param,code,fragment", BAD_BODIES, ids=[str(i) for i in range(len(BAD_BODIES))])
def test_chat_schema_errors_name_the_field(client, body, param, code, fragment):
    assert_error(client.post(CHAT, json=body), 400, param, code, fragment)
    assert_ok_after(client)


@pytest.mark.parametrize("content", [b"{not json", b"", b"[1, 2]", b"\xff\xfe"])
def test_malformed_json_is_400(client, content):
    r = client.post(CHAT, content=content, headers={"content-type": "application/json"})
    assert_error(r, 400, None, "invalid_json")
    assert_ok_after(client)


def test_completions_schema_errors(client):
    base = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    assert_error(client.post("/v1/completions", json={"model": "tiny"}), 400, "prompt")
    assert_error(client.post("/v1/completions", json={**base, "prompt": [1, "a"]}), 400, "prompt")
    assert_error(client.post("/v1/completions", json={**base, "prompt": [999999]}), 400, "prompt", None,
                 "out of range")
    assert_error(client.post("/v1/completions", json={**base, "logprobs": 50}), 400, "logprobs")
    assert_error(client.post("/v1/completions", json={**base, "echo": True}), 400, "echo")
    assert_error(client.post("/v1/completions", json={**base, "suffix": "x"}), 400, "suffix")
    assert_error(client.post("/v1/completions", json={**base, "best_of": 3}), 400, "best_of")
    r = client.post("/v1/completions", json=base)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None


def test_unknown_model_is_404(client):
    assert_error(client.post(CHAT, json={**GOOD, "model": "no-such-model"}), 404, "model", "model_not_found",
                 "no-such-model")
    assert_ok_after(client)


def test_prompt_longer_than_context_is_400_with_both_lengths(client, server):
    long = "word " * 400
    r = client.post(CHAT, json={**GOOD, "messages": [{"role": "user", "content": long}]})
    err = assert_error(r, 400, "messages", "context_length_exceeded")
    ctx = server.manager.entries["tiny"].engine.max_model_len
    assert str(ctx) in err["message"]
    assert any(int(w) > ctx for w in err["message"].replace(",", " ").split() if w.isdigit()), err
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": long, "max_tokens": 2})
    assert_error(r, 400, "prompt", "context_length_exceeded")
    assert_ok_after(client)


def test_body_over_limit_is_413(client):
    big = {**GOOD, "messages": [{"role": "user", "content": "x" * 100_000}]}
    assert_error(client.post(CHAT, json=big), 413, None, "request_too_large", "limit")

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(20):
            yield b" " * 10_000
    r = client.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
    assert_error(r, 413, None, "request_too_large")
    assert_ok_after(client)


def test_unknown_route_and_method(client):
    assert_error(client.get("/v1/nothing"), 404, None, "not_found", "/v1/nothing")
    assert_error(client.get(CHAT), 405, None, None, "Method Not Allowed")
    r = client.get("/api/nothing")
    assert r.status_code == 404 and "/api/nothing" in r.json()["error"]
    assert_ok_after(client)


def test_queue_full_is_429_with_retry_after(tiny_path):
    """Exactly --max-queue requests wait; the next one gets 429 with Retry-After, through OpenAI and Ollama."""
    max_queue = 3
    cfg = ServerConfig(engine=EngineConfig(kv_cache_gb=0.01, max_num_seqs=1, max_waiting=max_queue),
                       models=(str(tiny_path),), keep_alive=None)
    with serve(cfg) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        assert_ok_after(c)  # loads the model
        core = s.manager.entries["tiny"].engine.core
        gate, step = threading.Event(), core.step

        def gated_step():
            gate.wait()  # while the gate is shut no step runs: every accepted request stays queued
            return step()

        core.step = gated_step
        statuses: list[int] = []
        try:
            async def one(client: httpx.AsyncClient) -> None:
                statuses.append((await client.post(CHAT, json=GOOD)).status_code)

            async def main() -> None:
                async with httpx.AsyncClient(base_url=s.url, timeout=60) as ac, anyio.create_task_group() as tg:
                    for _ in range(max_queue):
                        tg.start_soon(one, ac)
                    queued = await anyio.to_thread.run_sync(
                        lambda: wait_until(lambda: core.stats().num_waiting == max_queue, timeout=30))
                    assert queued, core.stats()
                    # one over the limit is refused at once; were it let in, it would wait on the gate (timeout)
                    r = await ac.post(CHAT, json=GOOD, timeout=15)
                    assert r.status_code == 429, r.text
                    assert int(r.headers["retry-after"]) >= 1
                    err = r.json()["error"]
                    assert err["code"] == "queue_full" and err["type"] == "rate_limit_error", err
                    r = await ac.post("/api/chat", json={"model": "tiny", "stream": False, "options": {"num_predict": 3},
                                                         "messages": GOOD["messages"]}, timeout=15)
                    assert r.status_code == 429, r.text
                    assert set(r.json()) == {"error"} and "queue" in r.json()["error"], r.text
                    assert core.stats().num_waiting == max_queue  # the refused ones left nothing behind
                    gate.set()

            anyio.run(main)
        finally:
            gate.set()
            core.step = step
        assert statuses == [200] * max_queue  # every request that was let in is answered
        assert_ok_after(c)


def test_model_that_cannot_fit_is_507_with_the_estimate(tiny_path):
    with serve(ServerConfig(engine=EngineConfig(kv_cache_gb=1e6), models=(str(tiny_path),))) as s:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            err = assert_error(c.post(CHAT, json=GOOD), 507, "model", "insufficient_memory", "GiB")
            assert "KV cache 1000000.00 GiB" in err["message"] and "free" in err["message"]
            assert c.get("/health").status_code == 200
            assert s.manager.entries == {}  # nothing half-loaded stays behind
            engine = dataclasses.replace(s.manager.config.engine, kv_cache_gb=0.01)
            s.manager.config = dataclasses.replace(s.manager.config, engine=engine)
            assert_ok_after(c)


def test_api_key(tiny_path):
    with serve(ServerConfig(engine=EngineConfig(kv_cache_gb=0.01), models=(str(tiny_path),), api_key="s3cret")) as s:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                assert_error(c.post(CHAT, json=GOOD, headers=headers), 401, None, "invalid_api_key")
                assert_error(c.get("/v1/models", headers=headers), 401)
                assert c.get("/metrics", headers=headers).status_code == 401
                r = c.get("/api/tags", headers=headers)
                assert r.status_code == 401 and "API key" in r.json()["error"]
            assert c.get("/health").status_code == 200
            c.headers["Authorization"] = "Bearer s3cret"
            assert_ok_after(c)
            assert c.get("/v1/models").status_code == 200


def test_api_key_on_every_route(tiny_path):
    """Every route but the chat page and /health refuses a request without the key (401 in its API's error shape)
    and lets it through with `Authorization: Bearer KEY` or `x-api-key: KEY`."""
    from starlette.routing import Route

    with serve(ServerConfig(engine=EngineConfig(kv_cache_gb=0.01),
                            models=(str(tiny_path),), api_key="s3cret", allow_pull=False)) as s, \
            httpx.Client(base_url=s.url, timeout=60) as c:
        routes = [(r.path.replace("{", "").replace("}", ""), m) for r in s.app.routes if isinstance(r, Route)
                  for m in sorted(r.methods - {"HEAD"})]
        open_paths = {"/", "/health"}
        assert {"/v1/chat/completions", "/api/chat", "/api/generate", "/api/tags", "/metrics"} <= {p for p, _ in routes}
        for path, method in routes:
            if path in open_paths:
                continue
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}, {"Authorization": "s3cret"}):
                r = c.request(method, path, headers=headers, **({"json": {}} if method == "POST" else {}))
                assert r.status_code == 401, (path, method, headers, r.status_code)
                if path.startswith("/api/"):
                    assert set(r.json()) == {"error"} and "API key" in r.json()["error"], (path, r.text)
                elif path.startswith("/v1/") and not path.startswith("/v1/messages"):  # Anthropic's routes: own shape
                    assert r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
            for headers in ({"Authorization": "Bearer s3cret"}, {"x-api-key": "s3cret"}):
                r = c.request(method, path, headers=headers, **({"json": {}} if method == "POST" else {}))
                assert r.status_code != 401, (path, method, headers, r.text)
        for path in open_paths:
            assert c.get(path).status_code == 200, path


def test_ollama_errors_have_ollama_shape(client):
    r = client.post("/api/chat", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                       "options": {"mirostat": "on"}})
    assert r.status_code == 400 and "options.mirostat" in r.json()["error"]
    r = client.post("/api/generate", json={"model": "tiny", "prompt": "x", "keep_alive": "soon"})
    assert r.status_code == 400 and "keep_alive" in r.json()["error"]
    r = client.post("/api/generate", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and "nope" in r.json()["error"]
    r = client.post("/api/chat", content=b"{")
    assert r.status_code == 400 and "JSON" in r.json()["error"]
    r = client.post("/api/generate", json={"model": "tiny", "prompt": "x", "stream": False,
                                           "options": {"num_predict": 2}})
    assert r.status_code == 200 and r.json()["done"] is True


def test_reused_request_id_header_does_not_collide(client):
    async def main() -> list[int]:
        async with httpx.AsyncClient(base_url=client.base_url, timeout=60) as c:
            statuses: list[int] = []

            async def one() -> None:
                r = await c.post(CHAT, json={**GOOD, "max_tokens": 8}, headers={"X-Request-Id": "same-id"})
                assert r.headers["x-request-id"] == "same-id"
                statuses.append(r.status_code)

            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(one)
            return statuses

    assert anyio.run(main) == [200, 200, 200]
