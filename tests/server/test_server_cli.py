"""`edgeserve serve` as a process, its flags, and the keep-alive duration parser."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from edgeserve.cli import build_parser, main
from edgeserve.server.config import ServerConfig, parse_keep_alive
from server_helpers import free_port
from tiny_gguf import write_tiny_llama


@pytest.mark.parametrize("value,seconds", [("5m", 300.0), ("30s", 30.0), ("1h30m", 5400.0), ("250ms", 0.25),
                                           (0, 0.0), ("0", 0.0), (12.5, 12.5), ("-1", None), (-1, None),
                                           ("-5m", None)])
def test_parse_keep_alive(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5x", "", True, None, [1], "m5"])
def test_parse_keep_alive_rejects(value):
    with pytest.raises(ValueError, match="keep_alive"):
        parse_keep_alive(value)


def test_server_config_validates():
    with pytest.raises(ValueError, match="max_loaded_models"):
        ServerConfig(max_loaded_models=0)
    with pytest.raises(ValueError, match="port"):
        ServerConfig(port=70000)
    with pytest.raises(ValueError, match="dense_prefill"):
        ServerConfig(dense_prefill="yes")
    assert ServerConfig(models=["a.gguf"]).models == ("a.gguf",)


def test_serve_flags_parse():
    args = build_parser().parse_args(["serve", "-m", "a.gguf", "-m", "b", "--port", "9000", "--keep-alive", "-1",
                                      "--max-seqs", "4", "--api-key", "k", "--max-loaded-models", "2"])
    assert args.model == ["a.gguf", "b"] and args.port == 9000 and args.max_seqs == 4
    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"  # loopback unless asked


def test_serve_bad_flag_is_one_line(capsys):
    assert main(["serve", "--keep-alive", "soon"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("edgeserve: error:") and "--keep-alive" in err and "Traceback" not in err
    assert main(["serve", "--max-seqs", "0", "--no-pull"]) == 1
    assert "--max-seqs" in capsys.readouterr().err


@pytest.mark.parametrize("flags, fields", [
    (["--max-seqs", "0"], dict(max_num_seqs=0)),
    (["--kv-offload", "gpu"], dict(kv_offload="gpu")),
    (["--num-speculative-tokens", "99"], dict(num_speculative_tokens=99)),
    (["--spec-draft-vocab", "-1"], dict(spec_draft_vocab=-1)),
])
def test_a_bad_engine_value_is_the_same_line_on_every_surface(flags, fields, capsys):
    """One config tree: the Python API, ServerConfig and both CLI commands show EngineConfig's own message."""
    from edgeserve.engine.config import EngineConfig
    from edgeserve.errors import ConfigError
    from edgeserve.llm import LLM

    with pytest.raises(ConfigError) as raised:
        EngineConfig(**fields)
    message = str(raised.value)
    assert flags[0] in message and "\n" not in message
    with pytest.raises(ConfigError, match=re.escape(message)):
        LLM.from_model(None, **fields)  # the config is checked before the model is touched
    with pytest.raises(ConfigError, match=re.escape(message)):
        ServerConfig(engine=EngineConfig(**fields))
    for argv in (["serve", "--no-pull", *flags], ["run", *flags, "hi"]):
        assert main(argv) == 1
        assert capsys.readouterr().err == f"edgeserve: error: {message}\n"


def test_a_bad_keep_alive_is_the_same_line_for_the_flag_and_the_request_field(capsys):
    from edgeserve.server.errors import APIError
    from edgeserve.server.api.ollama import parse_ollama_generate

    with pytest.raises(ValueError) as raised:
        parse_keep_alive("soon")
    message = str(raised.value)
    assert "keep_alive" in message and "--keep-alive" in message
    assert main(["serve", "--keep-alive", "soon"]) == 1
    assert capsys.readouterr().err == f"edgeserve: error: {message}\n"
    with pytest.raises(APIError) as http:
        parse_ollama_generate({"model": "m", "prompt": "x", "keep_alive": "soon"})
    assert http.value.status == 400 and http.value.message == message


def test_serve_process_answers_and_stops(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    port = free_port()
    env = dict(os.environ, EDGESERVE_API_KEY="k1")
    proc = subprocess.Popen([sys.executable, "-m", "edgeserve", "serve", "--model", str(path), "--port", str(port),
                             "--keep-alive", "1s"], stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                health = json.loads(urllib.request.urlopen(url + "/health", timeout=2).read())
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
                time.sleep(0.1)
        assert health["models"] == {"tiny": "not loaded"}  # lazy: listed, nothing loaded yet
        # ignore_eos: the random model samples at temperature 1, and an end-of-text token would end the answer early
        body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2, "ignore_eos": True}).encode()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:  # the key comes from EDGESERVE_API_KEY
            urllib.request.urlopen(req, timeout=60)
        assert e.value.code == 401
        req.add_header("Authorization", "Bearer k1")
        out = json.loads(urllib.request.urlopen(req, timeout=60).read())
        assert out["usage"]["completion_tokens"] == 2
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode in (0, -15)
    assert "serving" in err and "loaded in" in err
    # the first lines say what the KV pool will take and why; the load line what it took
    first = err.splitlines()[:5]
    assert any(line.startswith("edgeserve: KV cache for tiny: ") and "full 128-token context" in line
               for line in first), first
    assert any("loaded in" in line and "KV pool" in line and "room for 4 requests" in line
               for line in err.splitlines())
    # log lines about the request carry its id
    rid_lines = [line for line in err.splitlines() if "prompt tokens" in line]
    assert rid_lines and all("[-]" not in line for line in rid_lines)


def test_mmproj_is_tied_to_the_model_before_it(tmp_path, capsys):
    """`-m VLM --mmproj MM -m other` gives MM to VLM alone: the other text model loads and answers without it."""
    import httpx

    from edgeserve.bench.random_mmproj import write_siglip_mmproj
    from edgeserve.cli import server_config_from_args
    from server_helpers import serve

    for d in ("vlm", "other"):
        (tmp_path / d).mkdir()
    vlm = write_tiny_llama(tmp_path / "vlm" / "vlm.gguf")
    other = write_tiny_llama(tmp_path / "other" / "other.gguf", hidden=64, layers=2, heads=4, kv_heads=2, ffn=128)
    shape = dict(kind="gemma3", hidden=32, ffn=64, layers=1, heads=2, patch=8, image=64, lm=48)
    proj = write_siglip_mmproj(tmp_path / "mm.gguf", shape, "F16")
    args = build_parser().parse_args(["serve", "-m", str(vlm), "--mmproj", str(proj), "-m", str(other),
                                      "--kv-cache-gb", "0.01", "--no-pull"])
    config = server_config_from_args(args)
    assert config.mmproj_for(str(vlm)) == str(proj) and config.mmproj_for(str(other)) is None
    with serve(config) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={"model": "other", "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        assert "vision" in c.post("/api/show", json={"model": "vlm"}).json()["capabilities"]
        assert "vision" not in c.post("/api/show", json={"model": "other"}).json()["capabilities"]
    # before any -m: the first model's; two for one model is a one-line error
    first = build_parser().parse_args(["serve", "--mmproj", str(proj), "-m", str(vlm), "-m", str(other)])
    assert server_config_from_args(first).mmproj == ((str(vlm), str(proj)),)
    assert main(["serve", "-m", str(vlm), "--mmproj", "a.gguf", "--mmproj", "b.gguf", "--no-pull"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("edgeserve: error: --mmproj") and err.count("\n") == 1
