"""The server examples run end to end against a live server (a tiny model, so they are quick)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from server_helpers import serve_tiny

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve_tiny(tmp_path_factory.mktemp("ex")) as s:
        yield s


def run(cmd: list[str], server, **env) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, EDGESERVE_URL=server.url + "/v1", EDGESERVE_HOST=server.url, **env))
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_openai_client_example(server):
    out = run([sys.executable, str(EXAMPLES / "openai_client.py"), "hello"], server)
    assert "[sync]" in out and "[stream]" in out and out.count("[async]") == 3 and "finish_reason=" in out


def test_ollama_client_example(server):
    out = run([sys.executable, str(EXAMPLES / "ollama_client.py"), "hello"], server)
    assert "[done:" in out and "[generate]" in out and "[unload] unload" in out and out.rstrip().endswith("[ps] []")


@pytest.mark.skipif(not shutil.which("curl"), reason="needs curl")
def test_curl_walkthrough(server):
    out = run(["bash", str(EXAMPLES / "curl.sh")], server)
    assert "data: [DONE]" in out and '"param": "temperature"' in out.replace('"param":"', '"param": "')
    assert "edgeserve_" in out and '"done_reason":"unload"' in out.replace(" ", "")
