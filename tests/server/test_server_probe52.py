"""Issue 52 item 7, through a test-started server: the requests that answered 500 (or a wrong 200) where a 400 is
due. An adapter onto an embedding model, a path too long to open, an absurd `lora` scale, non-finite logits, an
/api/create that points a PEFT pair at a system file, blobs larger than the JSON body limit, a keep_alive with
non-ASCII digits and the `expires_at` of a model kept forever."""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone

import httpx
import pytest
from server_helpers import serve
from tiny_gguf import write_tiny_llama

from edgeserve.bench.random_lora import random_pairs, write_peft
from edgeserve.engine.config import EngineConfig
from edgeserve.models.load import load_model
from edgeserve.registry import resolve
from edgeserve.server import ServerConfig
from edgeserve.server.config import parse_keep_alive

MiB = 1024 * 1024
PROMPT = [5, 9, 77, 12, 40, 41, 3, 200, 18, 7]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("probe52")
    text = write_tiny_llama(tmp / "tiny.gguf", seed=3)
    config = load_model(resolve(str(text))).config
    return dict(text=text, embed=write_tiny_llama(tmp / "tinyemb.gguf", pooling_type=1), tmp=tmp,
                good=write_peft(tmp / "good", random_pairs(config, 4, seed=1, std=0.4), 4, 8),
                # weights so large that the activations overflow: the logits come out inf / NaN
                huge=write_peft(tmp / "huge", random_pairs(config, 4, seed=2, std=1e25), 4, 8))


@pytest.fixture(scope="module")
def client(files, tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    mp = pytest.MonkeyPatch()
    mp.setenv("EDGESERVE_HOME", str(home))  # blobs land here
    cfg = ServerConfig(engine=EngineConfig(kv_cache_gb=0.01), models=(str(files["text"]), str(files["embed"])),
                       keep_alive=None, max_loaded_models=2, max_blob_bytes=40 * MiB)
    try:
        with serve(cfg) as s, httpx.Client(base_url=s.url, timeout=120) as c:
            c.home = home
            yield c
    finally:
        mp.undo()


def error_of(r: httpx.Response) -> dict:
    err = r.json()["error"]
    return err if isinstance(err, dict) else {"message": err}


def test_an_adapter_onto_an_embedding_model_is_400(client, files):
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "e", "lora_path": str(files["good"]),
                                                   "base_model": "tinyemb"})
    assert r.status_code == 400, r.text
    assert "embedding model" in error_of(r)["message"]
    r = client.post("/api/create", json={"model": "e2", "from": "tinyemb", "stream": False,
                                         "adapters": {"adapter_config.json": str(files["good"] / "adapter_config.json"),
                                                      "adapter_model.safetensors":
                                                          str(files["good"] / "adapter_model.safetensors")}})
    assert r.status_code == 400, r.text
    assert "embedding model" in r.json()["error"]
    assert client.get("/lora-adapters").json() == []


def test_a_lora_path_too_long_to_open_is_400(client):
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "long", "lora_path": "/tmp/" + "x" * 5000})
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == "lora_path"
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "long", "lora_path": "/tmp/" + "x" * 300})
    assert r.status_code == 400 and "cannot be read" in error_of(r)["message"], r.text  # a name over NAME_MAX


@pytest.mark.parametrize("scale", [1e30, -1e30, 1e6])
def test_an_absurd_lora_scale_is_400(client, files, scale):
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "good", "lora_path": str(files["good"])}
                       ).status_code == 200
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4,
                                             "lora": [{"id": 0, "scale": scale}]})
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == "lora" and "scale" in error_of(r)["message"]
    ok = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4,
                                              "lora": [{"id": 0, "scale": 2.0}]})
    assert ok.status_code == 200, ok.text


def test_non_finite_logits_end_the_request_with_an_error_not_a_stop(client, files):
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "huge", "lora_path": str(files["huge"])}
                       ).status_code == 200
    body = {"model": "huge", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 500, r.text
    assert "non-finite" in error_of(r)["message"]
    events = []
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        events = [line for line in s.iter_lines() if line.startswith("data: {")]
    assert "non-finite" in events[-1] and '"finish_reason": "stop"' not in "".join(events)
    # the base model goes on answering
    r = client.post("/v1/completions", json={**body, "model": "tiny"})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_a_refused_create_leaves_no_links_behind(client, files):
    adapters = {"adapter_config.json": "/etc/passwd", "adapter_model.safetensors": "/etc/passwd"}
    r = client.post("/api/create", json={"model": "evil", "from": "tiny", "adapters": adapters, "stream": False})
    assert r.status_code == 400, r.text
    folder = client.home / "blobs" / "adapters"
    assert not folder.exists() or not any(p.is_symlink() for p in folder.rglob("*")), list(folder.rglob("*"))
    # a good pair still links and loads
    pair = {n: str(files["good"] / n) for n in ("adapter_config.json", "adapter_model.safetensors")}
    r = client.post("/api/create", json={"model": "fine", "from": "tiny", "adapters": pair, "stream": False})
    assert r.status_code == 200, r.text
    assert sum(p.is_symlink() for p in folder.rglob("*")) == 2


def test_blobs_over_the_json_body_limit_stream_to_disk_under_their_own_limit(client):
    data = bytes(range(256)) * (33 * MiB // 256)  # over the 32 MiB JSON body limit
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    r = client.post(f"/api/blobs/{digest}", content=data)
    assert r.status_code == 201, r.text[:300]
    assert client.head(f"/api/blobs/{digest}").status_code == 200

    def chunks():  # no Content-Length: the blob limit holds while the bytes stream in
        for _ in range(41):
            yield b"\0" * MiB
    r = client.post("/api/blobs/sha256:" + "0" * 64, content=chunks())
    assert r.status_code == 413 and "40" in r.json()["error"], r.text[:300]
    assert not list((client.home / "blobs").glob(".upload-*"))  # nothing half-written stays
    # JSON routes keep the body limit
    big = {"model": "tiny", "prompt": "x" * (33 * MiB)}
    assert client.post("/v1/completions", json=big).status_code == 413


@pytest.mark.parametrize("value", ["١m", "٣٠s", "１h", "5m\u0660"])
def test_keep_alive_with_non_ascii_digits_is_400(client, value):
    with pytest.raises(ValueError):
        parse_keep_alive(value)
    r = client.post("/api/generate", json={"model": "tiny", "prompt": "hi", "keep_alive": value, "stream": False,
                                           "options": {"num_predict": 1}})
    assert r.status_code == 400 and "keep_alive" in r.json()["error"], r.text


def test_a_model_kept_forever_expires_far_in_the_future(client):
    r = client.post("/api/generate", json={"model": "tiny", "prompt": "hi", "keep_alive": -1, "stream": False,
                                           "options": {"num_predict": 1}})
    assert r.status_code == 200, r.text
    entry = next(m for m in client.get("/api/ps").json()["models"] if m["name"] == "tiny")
    expires = datetime.fromisoformat(entry["expires_at"].replace("Z", "+00:00"))
    assert expires.year > datetime.now(timezone.utc).year + 100, entry["expires_at"]
