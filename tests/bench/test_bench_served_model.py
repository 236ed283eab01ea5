"""`edgeserve bench --url URL` without `--model` benchmarks the model the server lists in /v1/models."""

from __future__ import annotations

import json

import pytest

from edgeserve.cli import main
from server_helpers import serve_tiny

ARGS = ["--num-requests", "2", "--prompt-tokens", "8", "--max-tokens", "3", "--warmup", "0", "--json", "-",
        "--no-progress"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve_tiny(tmp_path_factory.mktemp("bench")) as s:
        yield s


def test_bench_url_takes_the_model_from_v1_models(server, capsys):
    assert main(["bench", "--url", server.url, *ARGS]) == 0
    out = capsys.readouterr()
    doc = json.loads(out.out)
    assert doc["model"] == "tiny" and doc["levels"][0]["summary"]["completed"] == 2
    assert doc["prompt_format"] == "token ids"  # the served file's tokenizer, found through /api/show
    assert f"model tiny (from {server.url}/v1/models)" in out.err


def test_a_served_model_not_on_this_machine_gets_text_prompts(server, monkeypatch, capsys):
    import edgeserve.bench.command as command

    monkeypatch.setattr(command, "tokenizer_of_served_model", lambda url, kind, name: (None, None))
    assert main(["bench", "--url", server.url, *ARGS]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["prompt_format"] == "text" and "the prompts are text" in out.err
