"""Run an edgeserve app on a free loopback port in a background thread, for tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import uvicorn
from starlette.applications import Starlette

from edgeserve.server import ServerConfig, create_app


@dataclass
class RunningServer:
    """A server started by a test: its base URL and its app (to look inside the model manager)."""

    url: str
    app: Starlette

    @property
    def manager(self):
        return self.app.state.server.manager


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(config: ServerConfig) -> Iterator[RunningServer]:
    """Start uvicorn with create_app(config) in a thread; stop it (and wait) whatever happens."""
    with serve_app(create_app(config)) as running:
        yield running


@contextlib.contextmanager
def serve_app(app) -> Iterator[RunningServer]:
    """Start uvicorn with the ASGI `app` in a thread; stop it (and wait) whatever happens."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("test server did not start")
            time.sleep(0.02)
        yield RunningServer(f"http://127.0.0.1:{port}", app)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    """Poll `predicate` until it is true or `timeout` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def metric(text: str, name: str, labels: str = "") -> float | None:
    """The value of one sample in Prometheus text (`name{labels}`), or None."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key == name or (labels and key == f"{name}{{{labels}}}"):
            return float(value)
    return None


class StepGate:
    """Wraps the engine's step: while shut, each step waits for a permit; open() lets every step through."""

    def __init__(self, core) -> None:
        self.core, self.step = core, core.step
        self.permits, self.opened, self.waiting = threading.Semaphore(0), threading.Event(), threading.Event()
        core.step = self

    def __call__(self):
        if not self.opened.is_set():
            self.waiting.set()
            assert self.permits.acquire(timeout=60)
        return self.step()

    def allow(self, n: int) -> None:
        for _ in range(n):
            self.permits.release()

    def open(self) -> None:
        self.opened.set()
        self.allow(1000)

    def restore(self) -> None:
        self.open()
        self.core.step = self.step


def write_tool_and_think(folder: Path) -> tuple[str, str]:
    """scripted_gguf's two chat models in `folder`: tooly.gguf (answers with a tool call) and thinky.gguf (qwen3,
    thinks first); their paths."""
    from scripted_gguf import THINK_SCRIPT, THINK_TEMPLATE, TOOL_SCRIPT, TOOL_TEMPLATE, write_scripted_gguf

    tool = write_scripted_gguf(folder / "tooly.gguf", TOOL_SCRIPT, TOOL_TEMPLATE)
    think = write_scripted_gguf(folder / "thinky.gguf", THINK_SCRIPT, THINK_TEMPLATE, arch="qwen3")
    return str(tool), str(think)


@contextlib.contextmanager
def serve_scripted(folder: Path, *more: str) -> Iterator[RunningServer]:
    """A server (4 sequences, a small KV pool, no unloading) of write_tool_and_think's models and `more`."""
    from edgeserve.engine.config import EngineConfig

    with serve(ServerConfig(engine=EngineConfig(max_num_seqs=4, kv_cache_gb=0.05),
                            models=(*write_tool_and_think(folder), *more), keep_alive=None)) as s:
        yield s


@contextlib.contextmanager
def serve_tiny(folder: Path, **config) -> Iterator[RunningServer]:
    """A server of tiny_gguf's llama (written as `folder`/tiny.gguf, served as "tiny") with a 0.01 GB KV pool and no
    unloading; `config`: more ServerConfig fields."""
    from tiny_gguf import write_tiny_llama

    from edgeserve.engine.config import EngineConfig

    path = write_tiny_llama(folder / "tiny.gguf")
    with serve(ServerConfig(engine=EngineConfig(kv_cache_gb=0.01), models=(str(path),), keep_alive=None,
                            **config)) as s:
        yield s


@contextlib.contextmanager
def gated_steps(server: RunningServer, model: str = "tiny"):
    """A StepGate on the loaded `model`'s engine core, restored afterwards."""
    gate = StepGate(server.manager.entries[model].engine.core)
    try:
        yield gate
    finally:
        gate.restore()


def post_api(server: RunningServer, path: str, body: dict, stream: bool = False):
    """POST `body` to `path`, status 200 asserted: the JSON reply, or with `stream` the events (NDJSON lines for
    /api/chat, else SSE `data:` events but [DONE]) as a list."""
    import json

    import httpx

    if not stream:
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.strip()]
    if path == "/api/chat":
        return [json.loads(line) for line in lines]
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]


def server_fixture(start, folder_name: str, *args, **kwargs):
    """A module-scoped pytest fixture `server`: `start(tmp folder named folder_name, *args, **kwargs)` (serve_tiny,
    serve_scripted) entered for the module's tests and stopped after them. A test module assigns it to `server`."""
    import pytest

    @pytest.fixture(scope="module")
    def server(tmp_path_factory) -> Iterator[RunningServer]:
        with start(tmp_path_factory.mktemp(folder_name), *args, **kwargs) as s:
            yield s

    return server


def served_ids(server: RunningServer, *markers: str) -> tuple[str, ...]:
    """The id /v1/models lists for each of `markers` (the first id containing it)."""
    import httpx

    with httpx.Client(base_url=server.url, timeout=60) as c:
        ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
    return tuple(next(n for n in ids if marker in n) for marker in markers)


def concurrent_replies(server: RunningServer, n: int, one, **client_args) -> list:
    """`await one(client, i)` for i in 0..n-1, all at once over one openai.AsyncOpenAI client of the server's /v1
    (`client_args`: more client options); their results in order of i."""
    import anyio
    import openai

    async def main() -> list:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, **client_args)
        out: list = [None] * n

        async def run(i: int) -> None:
            out[i] = await one(client, i)

        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(run, i)
        await client.close()
        return out

    return anyio.run(main)
