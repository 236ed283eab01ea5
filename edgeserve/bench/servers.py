"""Start and stop server processes by pid (each in its own process group), wait for health, probe a server."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from edgeserve.errors import EdgeserveError


class ServerError(EdgeserveError):
    """A server could not be started, did not become healthy, or cannot be reached (one clear line)."""


@dataclass
class ServerProcess:
    """A server we started: its process, URL, command line and log file (stdout and stderr together)."""

    name: str
    proc: subprocess.Popen
    url: str
    cmd: list[str]
    log_path: Path
    notes: dict = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid


_LIVE: dict[int, ServerProcess] = {}
_LOCK = threading.Lock()
_HANDLERS_INSTALLED = False


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (and is not a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def log_tail(path: Path, lines: int = 1) -> str:
    """The last non-empty lines of a log file, joined with ' | ' ('' if none)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    rows = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " | ".join(rows[-lines:])


def stop_server(server: ServerProcess, timeout: float = 10.0) -> None:
    """Stop the server's whole process group: SIGTERM, then SIGKILL after `timeout`; reaps it. Idempotent."""
    proc = server.proc
    pgid = proc.pid  # started with start_new_session: the group id is the leader's pid, even after it exits
    if proc.poll() is None:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    try:  # anything left in the group (the server's children, or all of it after the timeout) goes too
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    with _LOCK:
        _LIVE.pop(proc.pid, None)


def stop_all() -> None:
    """Stop every server this process started and has not stopped yet."""
    with _LOCK:
        servers = list(_LIVE.values())
    for s in servers:
        stop_server(s, timeout=5.0)


def _on_signal(signum, frame) -> None:
    stop_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_handlers() -> None:
    global _HANDLERS_INSTALLED
    if _HANDLERS_INSTALLED:
        return
    _HANDLERS_INSTALLED = True
    atexit.register(stop_all)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                signal.signal(sig, _on_signal)


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """GET `url`: (status, body); raises OSError when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def http_post_json(url: str, body: dict, timeout: float = 2.0) -> tuple[int, object]:
    """POST `body` as JSON to `url`: (status, the parsed reply); raises OSError when nothing answers, ValueError
    when the reply is not JSON."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    return status, json.loads(raw)


def wait_healthy(server: ServerProcess, health_path: str, timeout: float) -> float:
    """Poll `health_path` until it answers 200; seconds waited. Raises ServerError (with the log's last line)
    if the process exits first or `timeout` passes; the caller stops the server."""
    t0 = time.monotonic()
    while True:
        rc = server.proc.poll()
        if rc is not None:
            tail = log_tail(server.log_path, 2)
            how = f"was killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
            raise ServerError(f"{server.name} {how} before it was ready"
                              + (f": {tail}" if tail else "") + f" (command: {' '.join(server.cmd)})")
        try:
            status, _ = http_get(server.url + health_path, timeout=2.0)
            if status == 200:
                return time.monotonic() - t0
        except OSError:
            pass
        if time.monotonic() - t0 > timeout:
            tail = log_tail(server.log_path, 1)
            raise ServerError(f"{server.name} did not become healthy at {server.url}{health_path} within "
                              f"{timeout:g}s" + (f" (last log line: {tail})" if tail else ""))
        time.sleep(0.1)


def start_server(name: str, cmd: Sequence[str], port: int, health_path: str = "/health", timeout: float = 300.0,
                 env: dict[str, str] | None = None, log_dir: str | os.PathLike[str] | None = None) -> ServerProcess:
    """Start `cmd` in its own process group (logs to a file), wait until `health_path` answers 200 and return
    it; on any failure it is stopped (by its process group) and ServerError says why."""
    _install_handlers()
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="edgeserve-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name.replace(' ', '_').replace('/', '_')}-{port}.log"
    try:
        log = open(log_path, "wb")
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)
    except OSError as e:
        raise ServerError(f"cannot start {name} ({cmd[0]}): {e.strerror or e}") from None
    finally:
        if "log" in locals():
            log.close()
    server = ServerProcess(name, proc, f"http://127.0.0.1:{port}", list(cmd), log_path)
    with _LOCK:
        _LIVE[proc.pid] = server
    try:
        server.notes["ready_s"] = wait_healthy(server, health_path, timeout)
    except BaseException:
        stop_server(server)
        raise
    return server


def start_edgeserve(model: str, max_seqs: int = 8, extra_args: Sequence[str] = (), timeout: float = 300.0,
                    env: dict[str, str] | None = None, log_dir: str | None = None) -> ServerProcess:
    """`python -m edgeserve serve` on a free loopback port with `model` (loaded at once by a warm-up request
    is up to the caller), waiting for /health."""
    port = free_port()
    cmd = [sys.executable, "-m", "edgeserve", "serve", "--model", model, "--port", str(port), "--max-seqs",
           str(max_seqs), "--log-level", "warning", "--keep-alive", "-1", *extra_args]
    return start_server("edgeserve", cmd, port, "/health", timeout, env, log_dir)


def detect_kind(url: str) -> str:
    """Which server answers at `url`: 'edgeserve', 'llama-server', 'llama-cpp-python' or 'openai' (unknown).
    Raises ServerError with one line if nothing answers."""
    try:
        status, body = http_get(url.rstrip("/") + "/health", timeout=5.0)
    except OSError as e:
        reason = getattr(e, "reason", e)
        raise ServerError(f"cannot reach a server at {url}: {reason}") from None
    if status == 200:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            obj = {}
        if isinstance(obj, dict) and "models" in obj and "loading" in obj:
            return "edgeserve"
    try:
        if http_get(url.rstrip("/") + "/props", timeout=5.0)[0] == 200:
            return "llama-server"
    except OSError:
        pass
    try:
        status, body = http_get(url.rstrip("/") + "/v1/models", timeout=5.0)
        if status == 200 and b"llama" in body.lower() and b"owned_by" in body and b'"me"' in body:
            return "llama-cpp-python"
    except OSError:
        pass
    return "openai"


def served_model(url: str) -> str | None:
    """The first model id `url`/v1/models lists (None if it lists none or does not answer)."""
    try:
        status, body = http_get(url.rstrip("/") + "/v1/models", timeout=10.0)
        data = json.loads(body).get("data") or []
        return data[0]["id"] if status == 200 and data else None
    except (OSError, ValueError, KeyError, AttributeError):
        return None


# Request fields each kind of server takes for a fixed-length, greedy benchmark request.
EXTRA_BODY = {
    "edgeserve": {"ignore_eos": True},
    "llama-server": {"ignore_eos": True, "cache_prompt": True, "repeat_penalty": 1.0},
    "llama-cpp-python": {"repeat_penalty": 1.0},
    "openai": {},
}
GREEDY_BODY = {  # a plain greedy request (for the correctness cross-check: ends where the model ends)
    "edgeserve": {},
    "llama-server": {"repeat_penalty": 1.0, "cache_prompt": True, "top_k": 1},
    "llama-cpp-python": {"repeat_penalty": 1.0, "top_k": 1},
    "openai": {},
}
TOKEN_ID_PROMPTS = {"edgeserve", "llama-server"}  # kinds whose /v1/completions takes token-id prompts


LLAMA_SERVER_BUILD = Path.home() / ".cache" / "edgeserve" / "reference" / "llama-server-build" / "bin"


def beside_llama_server_parser(doc: str, cases: Iterable[str]) -> argparse.ArgumentParser:
    """The options every beside-llama-server quality script takes: --cases (default: all of `cases`),
    --llama-server (the reference build's binary) and --keep (a folder for the checkpoints and GGUFs)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(cases))
    ap.add_argument("--llama-server", default=str(LLAMA_SERVER_BUILD / "llama-server"))
    ap.add_argument("--keep", help="a folder to keep the checkpoints and GGUFs in (reused when run again)")
    return ap


def llama_server_binary(path: str) -> Path:
    """`path` as a Path; a one-line exit when there is no file there."""
    binary = Path(path)
    if not binary.exists():
        raise SystemExit(f"no llama-server at {binary} (--llama-server)")
    return binary


@contextlib.contextmanager
def work_folder(keep: str | None) -> Iterator[Path]:
    """The folder `keep` (made if missing, left in place), else a temporary one removed afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(keep) if keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        yield work
