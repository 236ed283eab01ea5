"""A model's recommended sampling (GGUF general.sampling.*, generation_config.json) is every API's default for it;
a request's own value wins."""

from __future__ import annotations

import json

import httpx
import pytest

from edgeserve.engine.config import EngineConfig
from edgeserve.server import ServerConfig
from edgeserve.server.recommended_sampling import from_generation_config, from_gguf
from server_helpers import serve
from tiny_gguf import write_tiny_llama

PROMPT = "the cat sat on the mat and"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("recommended")
    picky = write_tiny_llama(tmp / "picky.gguf", extra_metadata={"general.sampling.top_k": 1,
                                                                  "general.sampling.temp": 1.5,
                                                                  "general.sampling.top_p": 0.95})
    plain = write_tiny_llama(tmp / "plain.gguf")
    config = ServerConfig(engine=EngineConfig(kv_cache_gb=0.02), models=(str(picky), str(plain)), keep_alive=None,
                          max_loaded_models=2)
    with serve(config) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        yield c


def _openai(c, model, **extra) -> str:
    r = c.post("/v1/chat/completions", json={"model": model, "max_tokens": 10, "ignore_eos": True,
                                             "messages": [{"role": "user", "content": PROMPT}], **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _ollama(c, model, **options) -> str:
    r = c.post("/api/generate", json={"model": model, "prompt": PROMPT, "stream": False,
                                      "options": {"num_predict": 10, **options}})
    assert r.status_code == 200, r.text
    return r.json()["response"]


def _anthropic(c, model) -> str:
    r = c.post("/v1/messages", json={"model": model, "max_tokens": 10,
                                     "messages": [{"role": "user", "content": PROMPT}]})
    assert r.status_code == 200, r.text
    return "".join(b.get("text", "") for b in r.json()["content"])


def _responses(c, model) -> str:
    r = c.post("/v1/responses", json={"model": model, "max_output_tokens": 10, "input": PROMPT})
    assert r.status_code == 200, r.text
    return "".join(part.get("text", "") for item in r.json()["output"] for part in item.get("content", []))


def test_every_api_takes_the_models_recommended_sampling(server):
    # top_k 1 from the file: whatever the seed, every API draws the same tokens
    assert len({_openai(server, "picky", seed=s) for s in (1, 2, 3)}) == 1
    assert len({_ollama(server, "picky", seed=s) for s in (1, 2, 3)}) == 1
    assert len({_anthropic(server, "picky") for _ in range(3)}) == 1
    assert len({_responses(server, "picky") for _ in range(3)}) == 1


def test_a_requests_own_value_wins_and_other_models_keep_the_server_default(server):
    assert len({_openai(server, "picky", seed=s, top_k=0) for s in (1, 2, 3, 4)}) > 1
    assert len({_ollama(server, "picky", seed=s, top_k=0) for s in (1, 2, 3, 4)}) > 1
    assert len({_openai(server, "plain", seed=s) for s in (1, 2, 3, 4)}) > 1


def test_responses_reports_the_sampling_it_ran_with(server):
    r = server.post("/v1/responses", json={"model": "picky", "max_output_tokens": 2, "input": PROMPT}).json()
    assert r["temperature"] == 1.5 and r["top_p"] == pytest.approx(0.95)
    r = server.post("/v1/responses", json={"model": "picky", "max_output_tokens": 2, "input": PROMPT,
                                           "temperature": 0.2}).json()
    assert r["temperature"] == 0.2


def test_show_lists_the_recommended_sampling(server):
    params = server.post("/api/show", json={"model": "picky"}).json()["parameters"].splitlines()
    assert "top_k 1" in params and "temperature 1.5" in params and "top_p 0.95" in params
    plain = server.post("/api/show", json={"model": "plain"}).json()["parameters"]
    assert "top_k" not in plain and "temperature" not in plain


def test_readers_keep_only_values_a_request_could_give(tmp_path):
    assert from_gguf({"general.sampling.temp": 0.6, "general.sampling.top_k": 20, "general.sampling.top_p": 7.0,
                      "general.sampling.penalty_repeat": 1.1, "general.sampling.mirostat": 2}) == {
        "temperature": 0.6, "top_k": 20, "repetition_penalty": 1.1}
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
         "min_p": "x", "max_new_tokens": 100}))
    assert from_generation_config(tmp_path) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                                "repetition_penalty": 1.05}
    assert from_generation_config(tmp_path / "none") == {}
