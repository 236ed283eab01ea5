"""The server's output-token default and maximum: `--default-max-tokens` for a request that sets no limit,
`--max-tokens-limit` for one that sets more; both in /api/show."""

from __future__ import annotations

import httpx
import pytest

from edgeserve.cli import build_parser, server_config_from_args
from edgeserve.engine.config import EngineConfig
from edgeserve.server import ServerConfig
from edgeserve.server.output_limit import output_tokens
from server_helpers import serve
from tiny_gguf import write_tiny_llama

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    tiny = write_tiny_llama(tmp_path_factory.mktemp("limit") / "tiny.gguf", context=128)
    config = ServerConfig(engine=EngineConfig(kv_cache_gb=0.01), models=(str(tiny),), keep_alive=None,
                          default_max_tokens=3, max_tokens_limit=5)
    with serve(config) as s, httpx.Client(base_url=s.url, timeout=120) as c:
        yield c


def test_a_request_without_a_limit_gets_the_default(client):
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3 and r.json()["choices"][0]["finish_reason"] == "length"
    r = client.post("/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False, "raw": True,
                                           "options": {"num_predict": -1, "temperature": 0}})
    assert r.status_code == 200, r.text
    assert r.json()["eval_count"] <= 3  # Ollama's "unlimited" is the server's default too


def test_a_larger_limit_is_lowered_to_the_maximum_and_a_smaller_one_kept(client):
    r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 100})
    assert r.json()["usage"]["completion_tokens"] == 5 and r.json()["choices"][0]["finish_reason"] == "length"
    r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
    assert r.json()["usage"]["completion_tokens"] == 2


def test_api_show_says_both(client):
    body = client.post("/api/show", json={"model": "tiny"}).json()
    assert "num_predict 3" in body["parameters"].splitlines()
    assert body["output_tokens"] == {"default_max_tokens": 3, "max_tokens_limit": 5}


@pytest.mark.parametrize("requested, default, limit, expected", [
    (None, 2048, None, 2048), (10, 2048, None, 10), (None, None, None, None), (None, None, 64, 64),
    (100, 8, 64, 64), (None, 100, 64, 64),
])
def test_output_tokens(requested, default, limit, expected):
    assert output_tokens(requested, ServerConfig(default_max_tokens=default, max_tokens_limit=limit)) == expected


def test_the_flags_reach_the_config(capsys):
    default = server_config_from_args(build_parser().parse_args(["serve"]))
    assert default.default_max_tokens == ServerConfig().default_max_tokens == 2048
    assert default.max_tokens_limit is None
    config = server_config_from_args(build_parser().parse_args(
        ["serve", "--default-max-tokens", "off", "--max-tokens-limit", "4096"]))
    assert config.default_max_tokens is None and config.max_tokens_limit == 4096
    with pytest.raises(ValueError, match="--max-tokens-limit"):
        ServerConfig(max_tokens_limit=0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--default-max-tokens", "0"])
