"""EmbeddingEngine: batches embedding requests of one encoder model and runs them in a worker thread.

Requests queue up while a batch runs; the next batch takes everything waiting (up to a token budget), so
concurrent clients share forwards. The forward runs off the event loop, so generation on other models and
the HTTP side keep going. There is no KV cache: an encoder sees each input once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread
import torch

from edgeserve.errors import EngineError

log = logging.getLogger(__name__)

CPU_SUB_BATCH_TOKENS = 2048  # on the CPU a forward this size runs near full speed, and takes a second or two
GPU_SUB_BATCH_TOKENS = 16384


def default_sub_batch(lm: Any) -> int:
    """Padded tokens per forward for `lm`: smaller on the CPU, where a forward is slow, so abandoned work stops
    soon."""
    device = getattr(getattr(lm, "model", None), "device", None)
    return GPU_SUB_BATCH_TOKENS if getattr(device, "type", "cpu") == "cuda" else CPU_SUB_BATCH_TOKENS


@dataclass
class EmbeddingStats:
    """An embedding engine's counters (for /metrics): requests in the batch running now and waiting for the next."""

    num_running: int = 0
    num_waiting: int = 0


@dataclass
class _Job:
    inputs: list[list[int]]
    done: anyio.Event = field(default_factory=anyio.Event)
    result: torch.Tensor | None = None
    error: BaseException | None = None
    abandoned: bool = False  # its caller went away: its inputs left in the batch are skipped


class EmbeddingEngine:
    """The engine of an embedding model: `await embed(token id lists)` -> [n, dim] float32 tensor."""

    is_embedding = True

    def __init__(self, lm: Any, max_batch_tokens: int = 16384, sub_batch_tokens: int | None = None) -> None:
        self.lm = lm
        self.max_batch_tokens = max_batch_tokens
        # padded tokens per forward: a request that goes away (or the server's stop) waits for at most one
        self.sub_batch_tokens = sub_batch_tokens if sub_batch_tokens is not None else default_sub_batch(lm)
        self.max_model_len = lm.config.max_seq_length
        self._queue: list[_Job] = []
        self._num_running = 0  # requests in the batch being embedded now
        self._wake = anyio.Event()
        self._shutdown = False

    async def embed(self, inputs: list[list[int]]) -> torch.Tensor:
        """Embeddings of token-id sequences (each at most max_model_len long), batched with other requests."""
        if self._shutdown:
            raise EngineError("the engine is shutting down")
        job = _Job(inputs)
        self._queue.append(job)
        self._wake.set()
        try:
            await job.done.wait()
        except BaseException:  # cancelled (the client went away): drop it, or skip what is left of it
            job.abandoned = True
            if job in self._queue:
                self._queue.remove(job)
            raise
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return job.result

    async def run(self) -> None:
        """Serve queued jobs until shutdown(): all waiting jobs (within the token budget) in one batch."""
        while not self._shutdown:
            if not self._queue:
                self._wake = anyio.Event()
                await self._wake.wait()
                continue
            jobs, tokens = [], 0
            while self._queue and (not jobs or tokens + self._tokens(self._queue[0]) <= self.max_batch_tokens):
                job = self._queue.pop(0)
                jobs.append(job)
                tokens += self._tokens(job)
            seqs = [ids for job in jobs for ids in job.inputs]
            owners = [job for job in jobs for _ in job.inputs]
            self._num_running = len(jobs)
            try:
                out = await anyio.to_thread.run_sync(self._forward, seqs, owners)
            except Exception as e:  # a failed batch fails its requests, not the engine
                if self._shutdown:
                    log.info("embedding batch stopped: the engine is shutting down")
                else:
                    log.exception("embedding batch failed")
                for job in jobs:
                    job.error = EngineError(f"embedding failed: {e}")
                    job.done.set()
                continue
            finally:
                self._num_running = 0
            i = 0
            for job in jobs:
                job.result = out[i: i + len(job.inputs)]
                i += len(job.inputs)
                job.done.set()
        for job in self._queue:
            job.error = EngineError("the engine is shutting down")
            job.done.set()
        self._queue.clear()

    def stats(self) -> EmbeddingStats:
        """Requests being embedded now and waiting for the next batch."""
        return EmbeddingStats(self._num_running, len(self._queue))

    @staticmethod
    def _tokens(job: _Job) -> int:
        return sum(len(ids) for ids in job.inputs)

    def _forward(self, seqs: list[list[int]], owners: list[_Job] | None = None) -> torch.Tensor:
        """The embeddings of `seqs` in sub-batches of up to sub_batch_tokens (padded); before each sub-batch, the
        inputs of abandoned jobs (`owners[i]` is seq i's) are skipped, and shutdown() skips everything left."""
        # sorted by length so each sub-batch pads little; results go back in request order
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        width = getattr(self.lm, "output_dim", self.lm.config.hidden_size)  # a reranker: its head's logits
        out = torch.empty(len(seqs), width, dtype=torch.float32)
        start = 0
        while start < len(order):
            end, longest = start, 0
            while end < len(order) and (end == start or (end - start + 1) * max(longest, len(seqs[order[end]]))
                                        <= min(self.sub_batch_tokens, self.max_batch_tokens)):
                longest = max(longest, len(seqs[order[end]]))
                end += 1
            idx = [i for i in order[start:end] if owners is None or not owners[i].abandoned]
            start = end
            if self._shutdown:
                raise EngineError("the engine is shutting down")
            if idx:
                out[idx] = self.lm.embed([seqs[i] for i in idx])
        return out

    def shutdown(self) -> None:
        """Stop run() at the batch in flight's next sub-batch; its requests and the waiting ones get an error."""
        self._shutdown = True
        self._wake.set()
