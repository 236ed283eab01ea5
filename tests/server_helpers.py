"""Run an edgeserve app on a free loopback port in a background thread, for tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass
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
