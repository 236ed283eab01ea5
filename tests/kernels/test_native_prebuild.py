"""Issue 52 item 8: the native CPU kernels compile when `serve` (or `run`) starts, with a progress line, not
silently inside the first request."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
import urllib.request

from server_helpers import free_port
from tiny_gguf import write_tiny_llama

from edgeserve.kernels.cpu import native as cpu_native


def test_prebuild_says_what_it_compiles_and_when_it_is_ready(monkeypatch):
    said, loaded = [], []
    monkeypatch.setattr(cpu_native, "best_variant", lambda: "avx2")
    monkeypatch.setattr(cpu_native, "enabled", lambda: True)
    monkeypatch.setattr(cpu_native, "compiler", lambda: "gcc")
    monkeypatch.setattr(cpu_native, "library", lambda: loaded.append(1) or object())
    monkeypatch.setattr(cpu_native, "is_built", lambda variant: False)
    cpu_native.prebuild(said.append)
    assert len(said) == 2 and loaded == [1]
    assert said[0].startswith("compiling the native CPU kernels for this CPU (avx2, with gcc)")
    assert said[1].startswith("native CPU kernels ready in")
    said.clear()
    monkeypatch.setattr(cpu_native, "is_built", lambda variant: True)  # cached: loaded, nothing said
    cpu_native.prebuild(said.append)
    assert said == [] and loaded == [1, 1]


def test_serve_compiles_the_kernels_at_start_with_a_progress_line(tmp_path):
    """A fresh edgeserve home: `serve` says it compiles the kernels before any request comes (the compiler here
    copies the library this test process has built, so the test stays quick)."""
    variant = cpu_native.best_variant()
    built = cpu_native.build(variant)
    fake_cc = tmp_path / "fakecc"
    fake_cc.write_text('#!/bin/sh\nwhile [ "$#" -gt 0 ]; do if [ "$1" = "-o" ]; then out="$2"; fi; shift; done\n'
                       f'cp "{built}" "$out"\n')
    fake_cc.chmod(fake_cc.stat().st_mode | stat.S_IEXEC)
    home = tmp_path / "home"
    env = dict(os.environ, EDGESERVE_HOME=str(home), CC=str(fake_cc))
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "edgeserve", "serve", "--model", str(path), "--port", str(port),
                             "--device", "cpu"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not list((home / "native").glob("qmatmul-*.so")):  # built with no request sent
            assert proc.poll() is None and time.monotonic() < deadline, "the kernels were not built at start"
            time.sleep(0.1)
        url = f"http://127.0.0.1:{port}"
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
                time.sleep(0.1)
        body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        assert json.loads(urllib.request.urlopen(req, timeout=60).read())["usage"]["completion_tokens"] == 2
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    lines = err.splitlines()
    compiling = [i for i, line in enumerate(lines) if "compiling the native CPU kernels" in line]
    ready = [i for i, line in enumerate(lines) if "native CPU kernels ready" in line]
    loaded = [i for i, line in enumerate(lines) if "loaded in" in line]
    assert compiling and ready and loaded and compiling[0] < ready[0] < loaded[0], err
    assert lines[compiling[0]].startswith("edgeserve: ")
