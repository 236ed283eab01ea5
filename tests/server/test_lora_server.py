"""LoRA adapters on the server (issue 40): listed in /v1/models and /api/tags, picked by `model` (NAME, BASE:NAME) or
llama-server's `lora` list, loaded and unloaded at runtime behind the API key while other requests stream."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from server_helpers import serve
from tiny_gguf import write_tiny_llama

from edgeserve.bench.random_lora import random_pairs, write_gguf_lora, write_peft
from edgeserve.engine.config import EngineConfig
from edgeserve.models.load import load_model
from edgeserve.registry import resolve
from edgeserve.server import ServerConfig

KEY = {"Authorization": "Bearer k"}
PROMPT = [5, 9, 77, 12, 40, 41, 3, 200, 18, 7, 8, 8, 100, 3, 50]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-server")
    path = write_tiny_llama(tmp / "tiny.gguf", hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, seed=5)
    config = load_model(resolve(str(path))).config
    small = load_model(resolve(str(write_tiny_llama(tmp / "small.gguf", hidden=32, layers=2, heads=4, kv_heads=2,
                                                    ffn=64)))).config
    return dict(base=path, tmp=tmp,
                a=write_peft(tmp / "a", random_pairs(config, 8, seed=1, std=0.4), 8, 16),
                b=write_gguf_lora(tmp / "b.gguf", random_pairs(config, 4, seed=2, std=0.4), 8, config),
                c=write_peft(tmp / "c", random_pairs(config, 4, seed=3, std=0.4), 4, 8),
                wrong=write_peft(tmp / "wrong", random_pairs(small, 4, seed=4), 4, 8))


@pytest.fixture(scope="module")
def client(files):
    engine = EngineConfig(kv_cache_gb=0.01, loras=(("a", str(files["a"])), ("b", str(files["b"]))))
    with serve(ServerConfig(engine=engine, models=(str(files["base"]),), keep_alive=None, api_key="k")) as s:
        with httpx.Client(base_url=s.url, timeout=120, headers=KEY) as c:
            yield c


def complete(client, model: str, **extra) -> str:
    r = client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                             "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_adapters_are_listed(client):
    models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert models["a"]["parent"] == "tiny" and models["b"]["parent"] == "tiny"
    tags = {m["name"]: m for m in client.get("/api/tags").json()["models"]}
    assert tags["b"]["details"]["parent_model"] == "tiny" and tags["b"]["details"]["format"] == "gguf"
    assert tags["a"]["size"] > 0 and len(tags["a"]["digest"]) == 64
    assert [(x["id"], x["name"]) for x in client.get("/lora-adapters").json()] == [(0, "a"), (1, "b")]


def test_a_request_picks_its_adapter_by_model_name_or_lora_field(client):
    base, a, b = complete(client, "tiny"), complete(client, "a"), complete(client, "b")
    assert len({base, a, b}) == 3
    assert complete(client, "tiny:a") == a
    assert complete(client, "tiny", lora=[{"id": 1, "scale": 1.0}, {"id": 0, "scale": 0}]) == b
    assert complete(client, "tiny", lora=[{"id": 0, "scale": 0.0}]) == base
    r = client.post("/v1/chat/completions", json={"model": "a", "messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "a"


def test_bad_adapter_choices_are_clear_errors(client):
    def err(model, **extra):
        r = client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 2, **extra})
        return r.status_code, r.json()["error"]
    status, e = err("tiny", lora=[{"id": 7, "scale": 1}])
    assert status == 400 and e["param"] == "lora" and "not a loaded adapter" in e["message"]
    status, e = err("tiny", lora=[{"id": 0, "scale": 1}, {"id": 1, "scale": 1}])
    assert status == 400 and "at most one adapter" in e["message"]
    assert err("tiny", lora="a")[0] == 400
    assert err("tiny:nope")[0] == 404


@pytest.mark.parametrize("name,what", [("tiny", "a model's name"), ("smollm2-135m", "a model's name"),
                                       ("x" * 129, "at most 128")])
def test_load_lora_adapter_refuses_model_names_and_long_names(client, files, name, what):
    r = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(files["c"])})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "lora_name" and what in err["message"]
    # the served model still answers as itself, without any adapter
    assert name not in [x["name"] for x in client.get("/lora-adapters").json()]
    assert complete(client, "tiny") == complete(client, "tiny", lora=[{"id": 0, "scale": 0.0}])


def test_load_and_unload_at_runtime_while_another_request_streams(client, files):
    lines: list[str] = []
    started = threading.Event()

    def stream():
        with client.stream("POST", "/v1/completions", json={"model": "a", "prompt": PROMPT, "max_tokens": 60,
                                                            "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    lines.append(line)
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    unauth = httpx.post(str(client.base_url) + "/v1/load_lora_adapter", json={"lora_name": "c",
                                                                             "lora_path": str(files["c"])})
    assert unauth.status_code == 401
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(files["c"])})
    assert r.status_code == 200, r.text
    assert complete(client, "c") != complete(client, "tiny")
    bad = client.post("/v1/load_lora_adapter", json={"lora_name": "w", "lora_path": str(files["wrong"])})
    assert bad.status_code == 400 and "do not fit" in bad.json()["error"]["message"]
    missing = client.post("/v1/load_lora_adapter", json={"lora_name": "m", "lora_path": str(files["tmp"] / "no")})
    assert missing.status_code == 400 and "does not exist" in missing.json()["error"]["message"]
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200  # a is streaming
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "c"}).status_code == 200
    assert client.post("/v1/completions", json={"model": "c", "prompt": PROMPT, "max_tokens": 2}).status_code == 404
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "c"}).status_code == 404
    t.join(120)
    finish = [json.loads(x[6:])["choices"][0].get("finish_reason") for x in lines]
    assert finish[-1] == "length" and sum(len(json.loads(x[6:])["choices"][0]["text"]) > 0 for x in lines) > 10
    ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert "a" not in ids and "c" not in ids and "b" in ids


def test_structured_output_with_an_adapter(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.post("/v1/chat/completions", json={
        "model": "b", "messages": [{"role": "user", "content": "answer"}], "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and isinstance(json.loads(choice["message"]["content"])["ok"], bool)


def test_ollama_create_makes_an_adapter_model_from_pushed_blobs(client, files, tmp_path, monkeypatch):
    """Ollama's clients push the adapter's files as blobs, then /api/create {model, from, adapters}: the new name
    lists in /api/tags and /v1/models and serves the adapter; bad input is a 400 naming the field."""
    import hashlib

    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path / "home"))  # blobs land here
    digests = {}
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        data = (files["c"] / name).read_bytes()
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        assert client.head(f"/api/blobs/{digest}").status_code == 404
        assert client.post(f"/api/blobs/{digest}", content=data).status_code == 201
        assert client.head(f"/api/blobs/{digest}").status_code == 200
        digests[name] = digest
    bad = client.post("/api/blobs/sha256:" + "0" * 64, content=b"other bytes")
    assert bad.status_code == 400 and "digest" in bad.json()["error"]  # Ollama's error shape: {"error": "..."}
    r = client.post("/api/create", json={"model": "coder:latest", "from": "tiny", "adapters": digests,
                                         "stream": False})
    assert r.status_code == 200 and r.json() == {"status": "success"}, r.text
    tags = {m["name"]: m for m in client.get("/api/tags").json()["models"]}
    assert tags["coder"]["details"]["parent_model"] == "tiny"
    assert {m["id"]: m.get("parent") for m in client.get("/v1/models").json()["data"]}["coder"] == "tiny"
    assert complete(client, "coder") != complete(client, "tiny")
    gguf = client.post("/api/create", json={"model": "g", "from": "tiny", "adapters": {"x.gguf": str(files["b"])}})
    assert gguf.status_code == 200 and gguf.text.strip().splitlines()[-1] == '{"status": "success"}'
    assert complete(client, "g") == complete(client, "b")  # the same GGUF file as adapter b, by local path
    for body, field in [({"from": "tiny", "adapters": digests}, "model"),
                        ({"model": "x", "adapters": digests}, "from"),
                        ({"model": "x", "from": "nope", "adapters": digests}, "from"),
                        ({"model": "x", "from": "tiny"}, "adapters"),
                        ({"model": "x", "from": "tiny", "adapters": {"a.gguf": "sha256:" + "1" * 64}}, "adapters"),
                        ({"model": "x", "from": "tiny", "adapters": {"a.gguf": "sha256:xyz"}}, "adapters"),
                        ({"model": "x", "from": "tiny", "adapters": digests, "quantize": "q4_0"}, "quantize"),
                        ({"model": "gemma3-270m", "from": "tiny", "adapters": digests}, "base model's name"),
                        ({"model": "x", "from": "tiny", "adapters": {"w": str(files["wrong"])}}, "do not fit")]:
        r = client.post("/api/create", json=body)
        assert r.status_code == 400 and field in r.json()["error"], (body, r.text)
    for name in ("coder", "g"):
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": name}).status_code == 200


def test_ollama_client_library_creates_an_adapter_model(client, files, tmp_path, monkeypatch):
    """Ollama's own Python client: create_blob pushes each adapter file, create(from_, adapters) names the model,
    generate serves it, and a bad adapter comes back as its ResponseError with our message."""
    ollama = pytest.importorskip("ollama")
    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path / "home"))
    ol = ollama.Client(host=str(client.base_url), headers=KEY)
    digests = {name: ol.create_blob(files["c"] / name) for name in ("adapter_config.json", "adapter_model.safetensors")}
    assert all(d.startswith("sha256:") for d in digests.values())
    assert ol.create("viaclient", from_="tiny", adapters=digests).status == "success"
    assert "viaclient" in {m.model for m in ol.list().models}
    opts = {"temperature": 0, "num_predict": 8}
    ours = ol.generate(model="viaclient", prompt="hello there", raw=True, options=opts).response
    base = ol.generate(model="tiny", prompt="hello there", raw=True, options=opts).response
    assert ours != base
    with pytest.raises(ollama.ResponseError) as e:
        ol.create("broken", from_="tiny", adapters={"a.gguf": "sha256:" + "1" * 64})
    assert e.value.status_code == 400 and "adapters" in e.value.error
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "viaclient"}).status_code == 200
