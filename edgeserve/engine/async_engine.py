"""AsyncEngine: the engine on an anyio event loop.

The device step runs on a worker thread; while it runs, the loop turns the previous step's token ids into
text (detokenize, stop strings) and hands deltas to each request's stream, so CPU text work overlaps
device work. A stop string found there ends its request at the start of the next step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from edgeserve.errors import EngineError, PromptTooLongError  # noqa: F401  (re-exported for callers)
from edgeserve.models.load import LoadedModel
from edgeserve.sampling_params import SamplingParams

from .config import EngineConfig
from .core import EngineCore, TokenOutput
from .output_processor import OutputProcessor
from .outputs import EngineStats, RequestOutput

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


class AsyncEngine:
    """One model's engine: `submit()` requests from any task; `run()` steps them until `shutdown()`."""

    def __init__(self, lm: LoadedModel, config: EngineConfig = EngineConfig(), draft: LoadedModel | None = None) -> None:
        self.lm = lm
        self.core = EngineCore(lm, config, draft=draft)
        self.max_model_len = self.core.max_model_len
        self._streams: dict[str, tuple[MemoryObjectSendStream, OutputProcessor]] = {}
        self._wakeup = anyio.Event()
        self._shutdown = False
        self.running = False

    # --- requests --------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> RequestStream:
        """Queue a request and return its stream; PromptTooLongError, QueueFullError or ValueError raise now."""
        if self._shutdown:
            raise EngineError("the engine is shutting down")
        rid = self.core.add_request(prompt_ids, params, request_id)
        send, receive = anyio.create_memory_object_stream[RequestOutput | Exception](math.inf)
        self._streams[rid] = (send, OutputProcessor(rid, prompt_ids, params, self.lm.tokenizer))
        self._wakeup.set()
        return RequestStream(self, rid, receive)

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submit and yield the deltas; leaving the loop early (or being cancelled) aborts the request."""
        stream = self.submit(prompt_ids, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Cancel a request; its blocks are freed at the start of the next step."""
        entry = self._streams.pop(request_id, None)
        if entry is not None:
            entry[0].close()
            self.core.finish_request(request_id, "abort")
            self._wakeup.set()

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
        """Step until `shutdown()`: each device step overlaps delivery of the previous step's results."""
        self.running = True
        pending: list[TokenOutput] = []
        try:
            while not self._shutdown:
                if not self.core.has_work() and not pending:
                    self._wakeup = anyio.Event()
                    if not self.core.has_work() and not self._shutdown:
                        await self._wakeup.wait()
                    continue
                result: list[TokenOutput] = []
                failure: BaseException | None = None

                async def device_step() -> None:
                    nonlocal result, failure
                    try:
                        result = await anyio.to_thread.run_sync(self.core.step, abandon_on_cancel=False)
                    except Exception as e:  # a failed step ends the requests in flight, not the server
                        failure = e

                async with anyio.create_task_group() as tg:
                    if self.core.has_work():
                        tg.start_soon(device_step)
                    self._deliver(pending)
                pending = result
                if failure is not None:
                    log.error("engine step failed", exc_info=failure)
                    culprits = self.core.blame()
                    if culprits:  # one request's own sampling failed: it alone ends, the others step on
                        for rid in culprits:
                            self._fail_one(rid, EngineError("this request failed while sampling its next token"))
                    else:
                        self._fail_all(EngineError(f"the engine failed: {type(failure).__name__}"))
                    pending = []
        finally:
            self._deliver(pending)
            self._deliver(self.core.abort_all())
            self.core.close()  # cached prefixes down to the offload tiers (and disk) when offload is on
            for send, _ in self._streams.values():
                send.close()
            self._streams.clear()
            self.running = False

    def _deliver(self, outputs: list[TokenOutput]) -> None:
        """Turn token outputs into text deltas and hand them to their streams."""
        for out in outputs:
            entry = self._streams.get(out.request_id)
            if entry is None:
                continue  # aborted by its consumer
            send, proc = entry
            try:
                delta = proc.process(out)
            except Exception as e:  # noqa: BLE001 - detokenizing one request's tokens failed: end it alone
                log.error("request %s failed while turning tokens into text", out.request_id, exc_info=e)
                self._fail_one(out.request_id, EngineError("this request failed while turning tokens into text"))
                if not out.finish_reason:
                    self.core.finish_request(out.request_id, "abort")
                continue
            if delta is None:
                continue
            send.send_nowait(delta)
            if proc.stopped_by_string and not out.finish_reason:
                self.core.finish_request(out.request_id, "stop")
            if delta.finished:
                send.close()
                del self._streams[out.request_id]

    def _fail_one(self, request_id: str, error: Exception) -> None:
        """Hand `error` to one request's stream and close it (the core has ended or will end the request)."""
        entry = self._streams.pop(request_id, None)
        if entry is not None:
            entry[0].send_nowait(error)
            entry[0].close()

    def _fail_all(self, error: Exception) -> None:
        self.core.abort_all()
        for send, _ in self._streams.values():
            send.send_nowait(error)
            send.close()
        self._streams.clear()
