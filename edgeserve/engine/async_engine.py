"""AsyncEngine: the engine on an anyio event loop.

The step runs on a worker thread and hands back text deltas (detokenizing and stop strings happen inside the
step, so a stop string ends its request before the next step is scheduled); the loop routes them to each
request's stream through the Outbox the `LLM` class uses too.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from edgeserve.errors import EngineError, PromptTooLongError  # noqa: F401  (re-exported for callers)
from edgeserve.models.load import LoadedModel
from edgeserve.sampling_params import SamplingParams

from .config import EngineConfig
from .core import EngineCore
from .delivery import Outbox
from .outputs import EngineStats, RequestOutput
from .cache.prefix_key import NO_KEY, PrefixKey
from .sched.request_state import AttendSpan, ImageRows

if TYPE_CHECKING:
    from edgeserve.models.mrope import MRopePositions
    from edgeserve.engine.sched.thinking_budget import ThinkingBudget

log = logging.getLogger("edgeserve.engine")


class RequestStream:
    """One request's deltas as an async iterator; the last one has `finish_reason` set."""

    def __init__(self, engine: "AsyncEngine", request_id: str,
                 receive: MemoryObjectReceiveStream[RequestOutput | Exception]) -> None:
        self.request_id = request_id
        self._engine = engine
        self._receive = receive
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._receive.receive()
        except anyio.EndOfStream:
            self.finished = True
            raise StopAsyncIteration from None
        if isinstance(item, Exception):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Cancel the request (a no-op once it has finished); its blocks are freed at the next step."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class _StreamSink:
    """Delivers one request's deltas into its memory stream, closing it after the last one."""

    def __init__(self, send: MemoryObjectSendStream[RequestOutput | Exception]) -> None:
        self.send = send

    def __call__(self, item: RequestOutput | Exception) -> None:
        self.send.send_nowait(item)
        if isinstance(item, Exception) or item.finished:
            self.send.close()


class AsyncEngine:
    """One model's engine: `submit()` requests from any task; `run()` steps them until `shutdown()`."""

    def __init__(self, lm: LoadedModel, config: EngineConfig = EngineConfig(), draft: LoadedModel | None = None) -> None:
        """`draft`: the loaded draft model for `speculative="draft"` (the caller loads it)."""
        self.lm = lm
        self.core = EngineCore(lm, config, draft=draft)
        self.max_model_len = self.core.max_model_len
        self._outbox = Outbox()
        self._wakeup = anyio.Event()
        self._shutdown = False
        self.running = False

    # --- requests --------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
               prefix_key: PrefixKey = NO_KEY, adapter: str | None = None, adapter_scale: float = 1.0,
               images: Sequence[ImageRows] = (), mrope: MRopePositions | None = None,
               attend_spans: Sequence[AttendSpan] = ()) -> RequestStream:
        """Queue a request and return its stream; PromptTooLongError, QueueFullError or ValueError raise now.
        `adapter`: the LoRA adapter (by name) it runs at `adapter_scale`; `images`: embedding rows replacing prompt
        tokens, `mrope`: M-RoPE positions, `attend_spans`: bidirectional prompt spans (EngineCore.add_request)."""
        if self._shutdown:
            raise EngineError("the engine is shutting down")
        rid = self.core.add_request(prompt_ids, params, request_id, prefix_key, adapter, adapter_scale, images, mrope,
                                    attend_spans)
        send, receive = anyio.create_memory_object_stream[RequestOutput | Exception](math.inf)
        self._outbox.open(rid, _StreamSink(send))
        self._wakeup.set()
        return RequestStream(self, rid, receive)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       prefix_key: PrefixKey = NO_KEY, adapter: str | None = None, adapter_scale: float = 1.0,
                       images: Sequence[ImageRows] = (),
                       mrope: MRopePositions | None = None,
                       attend_spans: Sequence[AttendSpan] = ()) -> AsyncIterator[RequestOutput]:
        """Submit and yield the deltas; leaving the loop early (or being cancelled) aborts the request."""
        stream = self.submit(prompt_ids, params, request_id, prefix_key, adapter, adapter_scale, images, mrope,
                             attend_spans)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Cancel a request; its blocks are freed at the start of the next step."""
        sink = self._outbox.close(request_id)
        if sink is not None:
            sink.send.close()
            self.core.finish_request(request_id, "abort")
            self._wakeup.set()

    def end_thinking(self, request_id: str, spec: "ThinkingBudget") -> bool:
        """Close a running request's thought at its next step (EngineCore.end_thinking)."""
        ended = self.core.end_thinking(request_id, spec)
        self._wakeup.set()
        return ended

    def stats(self) -> EngineStats:
        """The engine's counters now."""
        return self.core.stats()

    @property
    def num_unfinished(self) -> int:
        return self.core.num_unfinished

    # --- the loop --------------------------------------------------------------

    def shutdown(self) -> None:
        """Make `run()` return; requests still running end with finish_reason 'abort'."""
        self._shutdown = True
        self._wakeup.set()

    async def run(self) -> None:
        """Step until `shutdown()`, delivering each step's deltas as soon as it returns."""
        self.running = True
        try:
            while not self._shutdown:
                if not self.core.has_work():
                    self._wakeup = anyio.Event()
                    if not self.core.has_work() and not self._shutdown:
                        await self._wakeup.wait()
                    continue
                try:
                    outputs = await anyio.to_thread.run_sync(self.core.step, abandon_on_cancel=False)
                except Exception as e:  # a failed step ends the requests in flight, not the server
                    log.error("engine step failed", exc_info=e)
                    culprits = self.core.blame()
                    if culprits:  # one request's own sampling failed: it alone ends, the others step on
                        for rid in culprits:
                            self._outbox.fail(rid, EngineError("this request failed while sampling its next token"))
                    else:
                        self.core.abort_all()
                        self._outbox.fail_all(EngineError(f"the engine failed: {type(e).__name__}"))
                    continue
                self._outbox.deliver(outputs)
        finally:
            self._outbox.deliver(self.core.abort_all())
            self.core.close()  # cached prefixes down to the offload tiers (and disk) when offload is on
            for sink in self._outbox.close_all():
                sink.send.close()
            self.running = False
