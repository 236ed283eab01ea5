"""benchmarks/serve/compare.py's process handling: a peer that fails to start or never becomes healthy is reported
in one clear line and nothing is left running. No real llama-server needed."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgeserve.bench.compare import first_difference, llama_server_command, main
from edgeserve.bench.servers import ServerError, pid_alive, start_server

ROOT = Path(__file__).resolve().parents[2]


def fake_peer(tmp_path: Path, body: str) -> Path:
    """An executable that records its pid (and a child's) and its arguments, then runs `body`."""
    script = tmp_path / "fake-llama-server"
    script.write_text("#!/bin/bash\n"
                      f"echo $$ >> {tmp_path}/pids\n"
                      f"echo \"$@\" > {tmp_path}/args\n"
                      f"sleep 600 & echo $! >> {tmp_path}/pids\n"
                      f"{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def pids(tmp_path: Path) -> list[int]:
    f = tmp_path / "pids"
    return [int(x) for x in f.read_text().split()] if f.exists() else []


def gone(ps: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in ps):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_peer_that_exits_at_once(tmp_path, capsys, default_model_path):
    script = fake_peer(tmp_path, "echo 'error: cannot load model' >&2; exit 3")
    rc = main(["--llama-server", str(script), "--model", str(default_model_path), "--server-timeout", "20",
               "--log-dir", str(tmp_path / "logs")])
    assert rc == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("compare: error: llama.cpp exited with status 3 before it was ready")
    assert "cannot load model" in err  # the peer's own last log line
    ps = pids(tmp_path)
    assert len(ps) == 2 and gone(ps)  # the script and the child it left behind (same process group)
    args = (tmp_path / "args").read_text().split()
    # the options it was started with: parallel slots = --max-seqs, context for 8 slots, continuous batching
    assert args[args.index("--parallel") + 1] == "8" and "--cont-batching" in args
    assert int(args[args.index("-c") + 1]) >= 8 * 4000
    assert args[args.index("--host") + 1] == "127.0.0.1" and args[args.index("-m") + 1] == str(default_model_path)


def test_peer_that_never_becomes_healthy(tmp_path, capsys, default_model_path):
    script = fake_peer(tmp_path, "wait")  # runs, never listens
    t0 = time.monotonic()
    rc = main(["--llama-server", str(script), "--model", str(default_model_path), "--server-timeout", "2",
               "--log-dir", str(tmp_path / "logs")])
    assert rc == 1 and time.monotonic() - t0 < 60
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("compare: error: llama.cpp did not become healthy") and "within 2s" in err
    ps = pids(tmp_path)
    assert len(ps) == 2 and gone(ps)


def test_llama_server_that_is_not_executable(tmp_path, capsys, default_model_path):
    assert main(["--llama-server", str(tmp_path / "missing"), "--model", str(default_model_path)]) == 1
    assert "is not an executable file" in capsys.readouterr().err


def test_bin_false_as_a_script(tmp_path, default_model_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve" / "compare.py"), "--llama-server", "/bin/false",
                           "--model", str(default_model_path), "--server-timeout", "20"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("compare: error: llama.cpp exited with status 1 before it was ready")
    assert "Traceback" not in proc.stderr


def test_server_stopped_when_the_caller_is_interrupted(tmp_path):
    """A SIGTERM to the comparison process stops the servers it started (signal handler + atexit)."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
            "from edgeserve.bench.servers import start_server\n"
            f"start_server('peer', [{str(fake_peer(tmp_path, 'wait'))!r}], 9, timeout=600, log_dir={str(tmp_path)!r})\n")
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 60
    while len(pids(tmp_path)) < 2:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.terminate()
    proc.wait(timeout=30)
    assert gone(pids(tmp_path))


def test_start_server_error_names_the_command(tmp_path):
    with pytest.raises(ServerError, match="cannot start peer"):
        start_server("peer", [str(tmp_path / "nope")], 9, timeout=1, log_dir=tmp_path)


def test_llama_server_command_and_token_diff():
    cmd = llama_server_command("/x/llama-server", "m.gguf", 1234, 4, 4200, 2)
    assert cmd[cmd.index("-c") + 1] == str(4 * 4200) and cmd[cmd.index("-t") + 1] == "2"
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
