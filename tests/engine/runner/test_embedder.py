"""EmbeddingEngine: requests that wait while a batch runs go together into the next forward, results come back
to the right requests, the forward runs off the event loop, a failed batch fails only its requests."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import SimpleNamespace

import anyio
import pytest
import torch

from edgeserve.engine.runner.embedder import EmbeddingEngine
from edgeserve.errors import EngineError


@dataclass
class _Cfg:
    hidden_size: int = 3
    max_seq_length: int = 16


class FakeEncoder:
    """Embeds a sequence as [len, first id, sum]; the first forward waits for `gate` (from another thread)."""

    def __init__(self) -> None:
        self.config = _Cfg()
        self.calls: list[list[list[int]]] = []
        self.gate = threading.Event()
        self.started = threading.Event()
        self.fail = False

    def embed(self, batch: list[list[int]]) -> torch.Tensor:
        self.calls.append(batch)
        self.started.set()
        assert self.gate.wait(10)
        if self.fail:
            raise RuntimeError("boom")
        return torch.tensor([[len(s), s[0], sum(s)] for s in batch], dtype=torch.float32)


def test_waiting_requests_share_the_next_forward():
    lm = FakeEncoder()
    engine = EmbeddingEngine(lm)
    results: dict[int, torch.Tensor] = {}

    async def one(i: int, inputs: list[list[int]]) -> None:
        results[i] = await engine.embed(inputs)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            tg.start_soon(one, 0, [[1, 2]])
            await anyio.to_thread.run_sync(lm.started.wait)  # the first forward is running (in a thread)
            for i in range(1, 5):
                tg.start_soon(one, i, [[i] * i, [i + 10]])
            await anyio.sleep(0)  # the event loop is free while the forward runs: the requests queue up
            while len(engine._queue) < 4:
                await anyio.sleep(0.001)
            lm.gate.set()
            while len(results) < 5:
                await anyio.sleep(0.001)
            engine.shutdown()

    anyio.run(main)
    assert len(lm.calls) == 2  # the four waiting requests went into one forward
    assert sorted(len(s) for s in lm.calls[1]) == sorted([i for i in range(1, 5)] + [1] * 4)
    for i in range(1, 5):
        assert results[i].tolist() == [[i, i, i * i], [1, i + 10, i + 10]]


def test_failed_batch_fails_its_requests_and_engine_goes_on():
    lm = FakeEncoder()
    lm.gate.set()
    engine = EmbeddingEngine(lm)
    out: list = []

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            lm.fail = True
            with pytest.raises(EngineError, match="boom"):
                await engine.embed([[1]])
            lm.fail = False
            out.append(await engine.embed([[7, 8]]))
            engine.shutdown()

    anyio.run(main)
    assert out[0].tolist() == [[2, 7, 15]]


def test_a_lone_request_is_not_held_for_a_batching_window(monkeypatch):
    """With the event loop's clock frozen, any timer-based wait for company (a batching window) would never end: a
    lone request must still be embedded and answered."""
    import asyncio

    lm = FakeEncoder()
    lm.gate.set()
    engine = EmbeddingEngine(lm)
    out: list[torch.Tensor] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        frozen = loop.time()
        monkeypatch.setattr(loop, "time", lambda: frozen)
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            out.append(await engine.embed([[4, 5]]))
            engine.shutdown()

    runner = threading.Thread(target=anyio.run, args=(main,), daemon=True)
    runner.start()
    runner.join(30)
    assert not runner.is_alive(), "the lone request was held back"
    assert lm.calls == [[[4, 5]]] and out[0].tolist() == [[2, 4, 9]]


def test_sub_batches_are_small_on_the_cpu_so_abandoned_work_stops_soon():
    from edgeserve.engine.runner.embedder import CPU_SUB_BATCH_TOKENS, GPU_SUB_BATCH_TOKENS, default_sub_batch

    enc = FakeEncoder()
    enc.gate.set()
    assert EmbeddingEngine(enc).sub_batch_tokens == CPU_SUB_BATCH_TOKENS < GPU_SUB_BATCH_TOKENS  # no device: CPU

    on_cuda = SimpleNamespace(model=SimpleNamespace(device=torch.device("cuda")))  # what it reads; nothing runs
    assert default_sub_batch(on_cuda) == GPU_SUB_BATCH_TOKENS
    engine = EmbeddingEngine(enc, sub_batch_tokens=8)  # two 4-token inputs per forward
    out = engine._forward([[1, 2, 3, 4]] * 5)
    assert [len(c) for c in enc.calls] == [2, 2, 1] and out.shape == (5, 3)
