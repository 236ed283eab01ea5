"""Ollama details: /api/show, tags and ps facts from the file, true durations, options.num_ctx, /api/delete,
/api/version, and a first streamed request that waits for a load getting its headers at once."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import threading
from math import prod

import gguf
import httpx
import pytest

from edgeserve.server import ServerConfig
from edgeserve.engine.config import EngineConfig
from server_helpers import serve
from tiny_gguf import write_tiny_llama


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("details") / "tiny.gguf")


@pytest.fixture(scope="module")
def client(tiny_path, default_model_path):
    with serve(ServerConfig(engine=EngineConfig(kv_cache_gb=0.01),
                            models=(str(tiny_path), "smollm2-135m"), keep_alive=None)) as s:
        with httpx.Client(base_url=s.url, timeout=120) as c:
            yield c


def _reader_facts(path):
    r = gguf.GGUFReader(str(path))
    params = sum(int(prod(int(d) for d in t.shape)) for t in r.tensors)
    field = r.fields.get("general.file_type")
    ftype = int(field.parts[field.data[0]][0]) if field is not None else None
    return params, ftype


def test_version_is_numeric(client):
    assert re.fullmatch(r"\d+\.\d+\.\d+", client.get("/api/version").json()["version"])


def test_show_reports_details_info_capabilities(client, default_model_path):
    r = client.post("/api/show", json={"model": "smollm2-135m"})
    assert r.status_code == 200
    body = r.json()
    params, ftype = _reader_facts(default_model_path)
    d = body["details"]
    assert d["format"] == "gguf" and d["family"] == "llama"
    assert d["quantization_level"] == gguf.LlamaFileType(ftype).name.replace("MOSTLY_", "")
    assert body["model_info"]["general.parameter_count"] == params
    assert d["parameter_size"] == f"{params / 1e6:.0f}M"
    assert body["model_info"]["llama.context_length"] > 0 and body["model_info"]["llama.embedding_length"] > 0
    assert body["capabilities"] == ["completion"]
    assert "{%" in body["template"]
    assert "stop" in body["parameters"] and body["license"]
    assert client.post("/api/show", json={"model": "nope"}).status_code == 404


def test_tags_and_ps_have_digest_size_and_details(client, tiny_path):
    tags = {m["name"]: m for m in client.get("/api/tags").json()["models"]}
    tiny = tags["tiny"]
    assert tiny["digest"] == "sha256:" + hashlib.sha256(tiny_path.read_bytes()).hexdigest()
    assert tiny["size"] == tiny_path.stat().st_size
    params, _ = _reader_facts(tiny_path)
    assert tiny["details"]["parameter_size"] == f"{params / 1e3:.0f}K"
    assert tiny["details"]["quantization_level"] == "F32"
    client.post("/api/generate", json={"model": "tiny", "prompt": "x", "stream": False,
                                       "options": {"num_predict": 1}})
    ps = {m["name"]: m for m in client.get("/api/ps").json()["models"]}
    assert ps["tiny"]["digest"] == tiny["digest"] and ps["tiny"]["details"] == tiny["details"]


def test_durations_are_measured(client):
    body = {"model": "tiny", "prompt": "hello there", "stream": False,
            "options": {"num_predict": 12, "temperature": 0}}
    r = client.post("/api/generate", json=body).json()
    assert r["eval_count"] > 1
    assert r["prompt_eval_duration"] > 0 and r["eval_duration"] > 0
    assert r["load_duration"] >= 0
    assert r["prompt_eval_duration"] + r["eval_duration"] <= r["total_duration"]
    lines = [json.loads(x) for x in client.post("/api/generate", json={**body, "stream": True}).text.splitlines()]
    last = lines[-1]
    assert last["done"] and last["eval_duration"] > 0 and last["prompt_eval_duration"] > 0


def test_num_ctx_is_honoured_never_truncates(client):
    base = {"model": "tiny", "prompt": "hello hello hello hello", "raw": True, "stream": False}
    n_prompt = client.post("/api/generate", json={**base, "options": {"num_predict": 1}}).json()["prompt_eval_count"]
    r = client.post("/api/generate", json={**base, "options": {"num_ctx": n_prompt - 1}})
    assert r.status_code == 400 and "num_ctx" in r.json()["error"] and str(n_prompt) in r.json()["error"]
    r = client.post("/api/generate", json={**base, "options": {"num_ctx": n_prompt + 3, "temperature": 0,
                                                                "num_predict": 50}})
    assert r.status_code == 200 and r.json()["eval_count"] <= 3
    r = client.post("/api/chat", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                       "options": {"num_ctx": 0}})
    assert r.status_code == 400 and "options.num_ctx" in r.json()["error"]
    # the model's own limit (128 tokens) still applies
    r = client.post("/api/generate", json={**base, "prompt": "hello " * 200, "options": {"num_ctx": 100000}})
    assert r.status_code == 400


def test_delete_pulled_model(tmp_path, monkeypatch, default_model_path, tiny_path):
    from edgeserve.registry import CATALOG, is_pulled

    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    entry = CATALOG["smollm2-135m"]
    for src in (default_model_path, default_model_path.with_name(default_model_path.name + ".verified")):
        shutil.copy2(src, home / "models" / src.name)  # keeps mtime_ns, so the verification record holds
    monkeypatch.setenv("EDGESERVE_HOME", str(home))
    assert is_pulled(entry.name)
    with serve(ServerConfig(engine=EngineConfig(kv_cache_gb=0.01), models=(str(tiny_path),), keep_alive=None)) as s:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert "smollm2-135m" in {m["name"] for m in c.get("/api/tags").json()["models"]}
            r = c.request("DELETE", "/api/delete", json={"model": "tiny"})
            assert r.status_code == 400 and "pulled" in r.json()["error"]
            assert c.request("DELETE", "/api/delete", json={"model": "smollm2-135m"}).json() == {"status": "success"}
            assert not (home / "models" / entry.filename).exists()
            assert "smollm2-135m" not in {m["name"] for m in c.get("/api/tags").json()["models"]}
            assert c.request("DELETE", "/api/delete", json={"model": "smollm2-135m"}).status_code == 404
            assert c.request("DELETE", "/api/delete", json={}).status_code == 400


HI = [{"role": "user", "content": "hi"}]
WAITING_STREAMS = {  # route -> (body, how the first line looks while the load is held, how the stream ends)
    "openai": ("/v1/chat/completions", {"model": "tiny", "messages": HI, "max_tokens": 3, "stream": True},
               lambda line: line.startswith(":"), lambda lines: lines[-1] == "data: [DONE]"),
    "responses": ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 3, "stream": True},
                  lambda line: line.startswith(":"), lambda lines: lines[-2].startswith("event: response.")),
    "anthropic": ("/v1/messages", {"model": "tiny", "messages": HI, "max_tokens": 3, "stream": True},
                  lambda line: line == "event: ping", lambda lines: lines[-2] == "event: message_stop"),
    "ollama": ("/api/chat", {"model": "tiny", "messages": HI, "options": {"num_predict": 3}}, None,
               lambda lines: json.loads(lines[-1])["done"] is True),
}


@pytest.mark.parametrize("api", sorted(WAITING_STREAMS))
def test_first_stream_gets_headers_and_keepalive_while_loading(tiny_path, monkeypatch, api):
    import edgeserve.models.load as load_mod

    path, body, first_ok, end_ok = WAITING_STREAMS[api]
    release = threading.Event()
    real = load_mod.load_model

    def held_load(*args, **kwargs):
        assert release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(load_mod, "load_model", held_load)
    monkeypatch.setattr("edgeserve.server.loading.LOAD_PING_SECONDS", 0.05)
    with serve(ServerConfig(engine=EngineConfig(kv_cache_gb=0.01), models=(str(tiny_path),), keep_alive=None)) as s:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.get("/health").json()["models"] == {"tiny": "not loaded"}
            with c.stream("POST", path, json=body) as r:
                assert r.status_code == 200  # the headers came while the load is still held
                lines = r.iter_lines()
                if first_ok is not None:
                    first = next(line for line in lines if line)
                    assert first_ok(first), first
                assert c.get("/health").json()["models"] == {"tiny": "loading"}
                release.set()
                rest = [line for line in lines if line]
            assert end_ok(rest), rest[-3:]
            assert c.get("/health").json()["models"] == {"tiny": "loaded"}
