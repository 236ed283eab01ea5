"""Hostile and odd requests (issue 22): each gets a 4xx in its API's shape, and a normal request running beside it
completes with exactly the text it has when alone."""

from __future__ import annotations

import json

import anyio
import httpx
import pytest

from edgeserve.engine.async_engine import AsyncEngine
from edgeserve.engine.config import EngineConfig
from edgeserve.errors import EngineError
from edgeserve.models.load import load_model
from edgeserve.registry import resolve
from edgeserve.sampling_params import SamplingParams
from edgeserve.server import ServerConfig
from edgeserve.server.body import MAX_JSON_DEPTH
from edgeserve.server.fields import RANGES
from server_helpers import serve
from tiny_gguf import write_tiny_llama

CHAT = "/v1/chat/completions"
BYSTANDER = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 12,
             "temperature": 0, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("hostile") / "tiny.gguf")


@pytest.fixture(scope="module")
def server(tiny_path):
    with serve(ServerConfig(engine=EngineConfig(kv_cache_gb=0.01),
                            models=(str(tiny_path),), keep_alive=None, max_n=4)) as s:
        yield s


@pytest.fixture(scope="module")
def alone_text(server) -> str:
    """The bystander's text with nothing else running (greedy, so any correct run gives exactly this)."""
    return anyio.run(_stream_text, server.url, BYSTANDER, None)


async def _stream_text(url: str, body: dict, started: anyio.Event | None) -> str:
    text = ""
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        async with c.stream("POST", CHAT, json=body) as r:
            assert r.status_code == 200
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for ch in chunk["choices"]:
                    text += ch["delta"].get("content") or ""
                if started is not None and not started.is_set():
                    started.set()
                    await anyio.sleep(0)  # let the hostile request go out while this stream is open
            assert done
    return text


def with_bystander(server, alone_text: str, send) -> httpx.Response:
    """Start the bystander stream, send the hostile request (`send(client)`) while it is open, and check the
    bystander's text is what it is alone; returns the hostile request's response."""
    out = {}

    async def main():
        started = anyio.Event()
        async with anyio.create_task_group() as tg:
            async def bystander():
                out["text"] = await _stream_text(server.url, BYSTANDER, started)

            tg.start_soon(bystander)
            await started.wait()
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
                out["response"] = await send(c)

    anyio.run(main)
    assert out["text"] == alone_text
    return out["response"]


def post(path: str, body=None, content: bytes | None = None):
    async def send(c: httpx.AsyncClient) -> httpx.Response:
        data = content if content is not None else json.dumps(body).encode()  # \ud800 escapes stay as sent
        return await c.post(path, content=data, headers={"content-type": "application/json"})
    return send


def openai_400(r: httpx.Response, param: str | None, *fragments: str) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    for f in fragments:
        assert f in err["message"], err
    for leak in ("Traceback", "unpacking", "set_int_max_str_digits", "Error:", "unhashable"):
        assert leak not in err["message"], err
    return err


def ollama_400(r: httpx.Response, *fragments: str) -> str:
    assert r.status_code == 400, r.text
    msg = r.json()["error"]
    assert isinstance(msg, str)
    for f in fragments:
        assert f in msg, msg
    return msg


CHAT_BASE = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 1}
OLLAMA_BASE = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": False}


# --- 1. numeric ranges ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("top_k", 2**63), ("top_k", 1e308), ("top_k", -1), ("seed", 2**64), ("seed", 1e300), ("max_tokens", 1e308),
    ("temperature", 1e308), ("top_p", 0), ("repetition_penalty", 1e6), ("presence_penalty", 3),
    ("logprobs", 10**30),
])
def test_out_of_range_numbers_are_400_naming_field_and_range(server, alone_text, field, value):
    path, body = (("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, field: value})
                  if field == "logprobs" else (CHAT, {**CHAT_BASE, field: value}))
    r = with_bystander(server, alone_text, post(path, body))
    rng = RANGES[field]
    openai_400(r, field, field, rng.describe())


@pytest.mark.parametrize("option,value", [("top_k", 2**63), ("top_k", 1e308), ("seed", -(2**70)),
                                          ("num_predict", 1e308), ("repeat_penalty", 0)])
def test_ollama_options_out_of_range_are_400(server, alone_text, option, value):
    r = with_bystander(server, alone_text, post("/api/chat", {**OLLAMA_BASE, "options": {option: value}}))
    ollama_400(r, f"options.{option}", "must be")


def test_numbers_in_range_still_work(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post(CHAT, json={**CHAT_BASE, "top_k": RANGES["top_k"].high, "seed": RANGES["seed"].high, "n": 2})
        assert r.status_code == 200, r.text
        r = c.post("/api/chat", json={**OLLAMA_BASE, "options": {"top_k": 40, "seed": -1, "num_predict": 2}})
        assert r.status_code == 200, r.text


def test_a_request_whose_sampling_fails_ends_alone(tiny_path):
    """Past the API edge: a request the sampler cannot handle fails by itself; the others in its steps finish
    with exactly their text when alone."""
    lm = load_model(resolve(str(tiny_path)))
    prompt = lm.tokenizer.encode("hello there", add_special_tokens=False)
    good = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    poisoned = SamplingParams(temperature=1.0, max_tokens=30, top_k=5)
    poisoned.top_k = 2**63  # what validation once let through: overflows the sampler's device copy

    async def collect(stream):
        ids = []
        async for d in stream:
            ids += d.token_ids
        return ids

    async def main():
        engine = AsyncEngine(lm, EngineConfig(kv_cache_gb=0.01))
        out = {}
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            try:
                out["alone"] = await collect(engine.submit(prompt, good))
                s1 = engine.submit(prompt, good)
                s2 = engine.submit(prompt, poisoned)
                s3 = engine.submit(prompt, good)
                with pytest.raises(EngineError, match="sampling"):
                    await collect(s2)
                out["with"] = [await collect(s1), await collect(s3)]
                out["after"] = await collect(engine.submit(prompt, good))
            finally:
                engine.shutdown()
        return out

    out = anyio.run(main)
    assert len(out["alone"]) == 30
    assert out["with"] == [out["alone"], out["alone"]]
    assert out["after"] == out["alone"]


# --- 2. JSON depth, Unicode, types ------------------------------------------------------------------------------

def test_deeply_nested_json_is_400_on_every_route(server, alone_text):
    deep = b'{"model": "tiny", "messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    for path in (CHAT, "/v1/completions", "/api/chat", "/api/generate", "/api/show", "/api/pull"):
        r = with_bystander(server, alone_text, post(path, content=deep))
        assert r.status_code == 400, (path, r.text)
        assert "nested too deeply" in r.text
    just_over = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "metadata": {}}
    node = just_over["metadata"]
    for _ in range(MAX_JSON_DEPTH):
        node["a"] = {}
        node = node["a"]
    r = with_bystander(server, alone_text, post(CHAT, just_over))
    assert r.status_code == 400 and "nested too deeply" in r.text


def test_huge_integer_literal_is_400_without_internals(server, alone_text):
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "seed": ' + b"9" * 5000 + b"}"
    r = with_bystander(server, alone_text, post(CHAT, content=body))
    assert r.status_code == 400 and "set_int_max_str_digits" not in r.text and "too long" in r.text


@pytest.mark.parametrize("path,body,param", [
    (CHAT, {**CHAT_BASE, "messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content"),
    ("/v1/completions", {"model": "tiny", "prompt": "\udc00"}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": ["ok", "\udfff"]}, "prompt[1]"),
    (CHAT, {**CHAT_BASE, "messages": [{"role": "system", "content": [{"type": "text", "text": "\ud83d"}]},
                                      {"role": "user", "content": "x"}]}, "messages[0].content[0].text"),
])
def test_lone_surrogates_are_400_naming_the_field(server, alone_text, path, body, param):
    r = with_bystander(server, alone_text, post(path, body))
    openai_400(r, param, param, "Unicode")


def test_raw_surrogate_bytes_are_400(server, alone_text):
    for path in (CHAT, "/api/generate"):
        body = (b'{"model": "tiny", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}' if path == CHAT
                else b'{"model": "tiny", "prompt": "hi", "system": "\xed\xa0\x80", "stream": false}')
        r = with_bystander(server, alone_text, post(path, content=body))
        assert r.status_code == 400, r.text
        assert "Unicode" in r.text and ("messages[0].content" in r.text or "system" in r.text)


@pytest.mark.parametrize("role", [["user"], {"a": 1}, 1])
def test_role_of_the_wrong_type_is_400(server, alone_text, role):
    r = with_bystander(server, alone_text, post(CHAT, {**CHAT_BASE, "messages": [{"role": role, "content": "x"}]}))
    openai_400(r, "messages[0].role", "role")
    r = with_bystander(server, alone_text, post("/api/chat", {**OLLAMA_BASE,
                                                              "messages": [{"role": role, "content": "x"}]}))
    ollama_400(r, "role")


@pytest.mark.parametrize("path,extra,name", [
    ("/api/chat", {"messages": 0}, "messages"), ("/api/chat", {"messages": ""}, "messages"),
    ("/api/chat", {"messages": {}}, "messages"), ("/api/chat", {"tools": 0}, "tools"),
    ("/api/chat", {"tools": ""}, "tools"), ("/api/chat", {"tools": {}}, "tools"), ("/api/chat", {"think": 0}, "think"),
    ("/api/chat", {"think": ""}, "think"),
    ("/api/chat", {"messages": [{"role": "user", "content": "x", "images": ""}]}, "images"),
    ("/api/generate", {"prompt": "x", "images": 0}, "images"), ("/api/generate", {"prompt": "x", "suffix": 0}, "suffix"),
    ("/api/generate", {"prompt": "x", "context": {}}, "context"),
    ("/api/generate", {"prompt": "x", "template": 0}, "template"),
    ("/api/generate", {"prompt": "x", "images": {}}, "images"),
])
def test_ollama_wrong_typed_empties_are_400(server, alone_text, path, extra, name):
    body = {"model": "tiny", "stream": False, **extra}
    r = with_bystander(server, alone_text, post(path, body))
    ollama_400(r, name)


def test_ollama_right_typed_empties_still_load_only(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for body in ({"model": "tiny", "messages": []}, {"model": "tiny", "messages": None, "tools": [],
                                                         "think": False}):
            r = c.post("/api/chat", json=body)
            assert r.status_code == 200 and r.json()["done_reason"] == "load", r.text
        r = c.post("/api/generate", json={"model": "tiny", "prompt": "", "images": [], "suffix": "", "context": []})
        assert r.status_code == 200 and r.json()["done_reason"] == "load", r.text


@pytest.mark.parametrize("extra,param", [({"echo": 0}, "echo"), ({"echo": "no"}, "echo"), ({"suffix": 0}, "suffix")])
def test_openai_completions_wrong_types_are_400(server, alone_text, extra, param):
    r = with_bystander(server, alone_text, post("/v1/completions", {"model": "tiny", "prompt": "x", **extra}))
    openai_400(r, param, param)


@pytest.mark.parametrize("path", ["/api/show", "/api/pull"])
def test_show_and_pull_reject_unknown_fields(server, alone_text, path):
    r = with_bystander(server, alone_text, post(path, {"model": "tiny", "bogus": 1}))
    ollama_400(r, "bogus")


# --- 3. keep_alive ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [1e300, "99999999999h", 10**400, "8761h", float("inf")])
def test_keep_alive_beyond_the_cap_is_400_and_ps_stays_ok(server, alone_text, value):
    body = {**OLLAMA_BASE, "keep_alive": value}
    content = None
    if value == float("inf"):
        content = json.dumps(body).encode()  # Infinity: Python's json reads it
    r = with_bystander(server, alone_text, post("/api/chat", body if content is None else None, content))
    ollama_400(r, "keep_alive", "one year")
    with httpx.Client(base_url=server.url, timeout=60) as c:
        ps = c.get("/api/ps")
        assert ps.status_code == 200, ps.text


def test_keep_alive_at_the_cap_and_negative_are_accepted(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for value in ("8760h", -1, "-5m"):
            r = c.post("/api/chat", json={"model": "tiny", "messages": [], "keep_alive": value})
            assert r.status_code == 200, r.text
            assert c.get("/api/ps").status_code == 200


def test_keep_alive_zero_during_a_stream_unloads_when_the_stream_ends(tiny_path):
    with serve(ServerConfig(engine=EngineConfig(kv_cache_gb=0.01), models=(str(tiny_path),), keep_alive=300)) as s:
        out = {}

        async def main():
            started, unloaded_asked = anyio.Event(), anyio.Event()

            async def stream():
                async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                    async with c.stream("POST", CHAT, json=BYSTANDER) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: {") and not started.is_set():
                                started.set()
                                await unloaded_asked.wait()  # the unload arrives while this stream is open
                            if line == "data: [DONE]":
                                out["done"] = True

            async with anyio.create_task_group() as tg:
                tg.start_soon(stream)
                await started.wait()
                async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                    r = await c.post("/api/chat", json={"model": "tiny", "messages": [], "keep_alive": 0})
                    out["unload"] = r.json()
                    unloaded_asked.set()

        anyio.run(main)
        assert out["done"] and out["unload"]["done_reason"] == "unload"
        from server_helpers import wait_until
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert wait_until(lambda: c.get("/api/ps").json()["models"] == [], timeout=20), \
                "keep_alive 0 sent during a stream was lost: the model is still loaded"


# --- 4. prompt count ------------------------------------------------------------------------------------------------

def test_too_many_prompts_is_400_with_the_limit(server, alone_text):
    r = with_bystander(server, alone_text, post("/v1/completions", {"model": "tiny", "prompt": ["x"] * 2000,
                                                                    "max_tokens": 1}))
    openai_400(r, "prompt", "at most 4")
    r = with_bystander(server, alone_text, post("/v1/completions", {"model": "tiny", "prompt": ["x"] * 3, "n": 2,
                                                                    "max_tokens": 1}))
    openai_400(r, "prompt", "at most 4")
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": ["x"] * 2, "n": 2, "max_tokens": 1})
        assert r.status_code == 200 and len(r.json()["choices"]) == 4


# --- 7. a configured model path that is a symlink to something else -------------------------------------------------

def test_symlink_to_a_non_gguf_file_reveals_neither_target_nor_bytes(tiny_path, tmp_path):
    secret = tmp_path / "private" / "secret-notes.txt"
    secret.parent.mkdir()
    secret.write_bytes(b"SECRET-CONTENT of the operator")
    evil = tmp_path / "evil.gguf"
    evil.symlink_to(secret)
    with serve(ServerConfig(engine=EngineConfig(kv_cache_gb=0.01), models=(str(tiny_path), str(evil)), keep_alive=None,
                            max_loaded_models=2)) as s:
        async def send(c: httpx.AsyncClient) -> httpx.Response:
            return await c.post(CHAT, json={**CHAT_BASE, "model": "evil"})

        alone = anyio.run(_stream_text, s.url, BYSTANDER, None)
        r = with_bystander(s, alone, send)
        assert r.status_code == 500, r.text
        msg = r.json()["error"]["message"]
        assert "not a GGUF file" in msg
        for leak in ("SECR", "secret-notes", "private"):
            assert leak not in msg, msg
        with httpx.Client(base_url=s.url, timeout=60) as c:
            names = [m["name"] for m in c.get("/api/tags").json()["models"]]
            assert "tiny" in names and "evil" not in names
            r = c.post("/api/generate", json={"model": "evil", "prompt": "hi", "stream": False})
            assert "not a GGUF file" in r.json()["error"] and "SECR" not in r.text and "secret" not in r.text
