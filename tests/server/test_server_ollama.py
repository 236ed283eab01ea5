"""The Ollama API: version, tags, ps, show, chat and generate with NDJSON streaming, options, pull."""

from __future__ import annotations

import json

import httpx
import pytest

from server_helpers import serve_tiny


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with serve_tiny(tmp_path_factory.mktemp("ollama")) as s:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            yield c


def ndjson(r: httpx.Response) -> list[dict]:
    assert r.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in r.text.splitlines() if line.strip()]


def test_version_tags_show(client):
    assert client.get("/api/version").json()["version"]
    tags = client.get("/api/tags").json()["models"]
    tiny = next(m for m in tags if m["name"] == "tiny")
    assert tiny["size"] > 1000 and tiny["details"]["format"] == "gguf"
    r = client.post("/api/show", json={"model": "tiny"})
    assert r.status_code == 200 and r.json()["details"]["format"] == "gguf"
    assert client.post("/api/show", json={"model": "nope"}).status_code == 404


def test_chat_streams_ndjson(client):
    body = {"model": "tiny", "messages": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "hello"}],
            "options": {"temperature": 0, "num_predict": 8}}
    lines = ndjson(client.post("/api/chat", json=body))
    assert len(lines) >= 2
    assert all(line["done"] is False for line in lines[:-1])
    last = lines[-1]
    assert last["done"] is True and last["done_reason"] in ("stop", "length")
    assert last["eval_count"] == 8 or last["done_reason"] == "stop"
    assert last["prompt_eval_count"] > 5 and last["total_duration"] > 0
    streamed = "".join(line["message"]["content"] for line in lines)
    # the same request not streamed gives the same (greedy) text
    one = client.post("/api/chat", json={**body, "stream": False}).json()
    assert one["done"] is True and one["message"]["role"] == "assistant"
    assert one["message"]["content"] == streamed
    assert one["eval_count"] == last["eval_count"]


def test_generate_options_are_honoured(client):
    base = {"model": "tiny", "prompt": "hello", "stream": False}
    r = client.post("/api/generate", json={**base, "options": {"num_predict": 3, "temperature": 0}}).json()
    assert r["eval_count"] == 3 and r["done_reason"] == "length"
    a = client.post("/api/generate", json={**base, "options": {"num_predict": 6, "seed": 5, "temperature": 1.5}})
    b = client.post("/api/generate", json={**base, "options": {"num_predict": 6, "seed": 5, "temperature": 1.5}})
    assert a.json()["response"] == b.json()["response"]
    greedy = client.post("/api/generate", json={**base, "options": {"num_predict": 12, "temperature": 0}})
    text = greedy.json()["response"]
    stop = text[3:5]
    if stop.strip():
        cut = client.post("/api/generate", json={**base, "options": {"num_predict": 12, "temperature": 0,
                                                                     "stop": [stop]}}).json()
        assert cut["response"] == text[: text.index(stop)] and cut["done_reason"] == "stop"
    raw = client.post("/api/generate", json={**base, "raw": True, "options": {"num_predict": 2}}).json()
    assert raw["prompt_eval_count"] < r["prompt_eval_count"]  # no chat template around the prompt
    lines = ndjson(client.post("/api/generate", json={"model": "tiny:latest", "prompt": "hi",
                                                       "options": {"num_predict": 4}}))
    assert lines[-1]["done"] and sum(1 for x in lines if not x["done"]) >= 1


def test_ps_lists_loaded_model(client):
    client.post("/api/generate", json={"model": "tiny", "prompt": "x", "stream": False, "options": {"num_predict": 1}})
    ps = client.get("/api/ps").json()["models"]
    assert [m["name"] for m in ps] == ["tiny"] and ps[0]["status"] == "loaded" and ps[0]["size"] > 0


def test_pull_streams_progress(client, default_model_path):
    lines = ndjson(client.post("/api/pull", json={"model": "smollm2-135m"}))
    assert lines[0]["status"] == "pulling manifest" and lines[-1]["status"] == "success"
    r = client.post("/api/pull", json={"model": "smollm2-135m", "stream": False})
    assert r.json() == {"status": "success"}
    r = client.post("/api/pull", json={"model": "not-in-catalog"})
    assert r.status_code == 404 and "catalog" in r.json()["error"]
