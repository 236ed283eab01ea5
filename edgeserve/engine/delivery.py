"""The one step-and-deliver loop: a step's text deltas routed to each request's consumer.

The server's AsyncEngine (a step on a worker thread, deltas into memory streams) and the `LLM` class (steps
in the caller's thread, deltas into results) both hand every step's outputs to an Outbox; text work, stop
strings and finishing all happened inside the step (EngineCore), so this only routes.
"""

from __future__ import annotations

from collections.abc import Callable

from edgeserve.errors import EngineError

from .core import EngineCore
from .outputs import RequestOutput

Sink = Callable[[RequestOutput | Exception], None]


class Outbox:
    """Each open request's consumer; a request is forgotten after its last delta (or its error)."""

    def __init__(self) -> None:
        self._sinks: dict[str, Sink] = {}

    def open(self, request_id: str, sink: Sink) -> None:
        """Send `request_id`'s deltas to `sink` from now on."""
        self._sinks[request_id] = sink

    def close(self, request_id: str) -> Sink | None:
        """Stop delivering to a request (its consumer left); returns its sink, None if it was not open."""
        return self._sinks.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._sinks

    def __len__(self) -> int:
        return len(self._sinks)

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand each delta to its request's sink; a delta carrying an error is handed over as an EngineError."""
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue  # its consumer left
            if out.error is not None:
                del self._sinks[out.request_id]
                sink(EngineError(out.error))
                continue
            if out.finished:
                del self._sinks[out.request_id]
            sink(out)

    def fail(self, request_id: str, error: Exception) -> None:
        """Hand `error` to one request's sink and forget it."""
        sink = self._sinks.pop(request_id, None)
        if sink is not None:
            sink(error)

    def close_all(self) -> list[Sink]:
        """Forget every open request; returns their sinks."""
        sinks, self._sinks = self._sinks, {}
        return list(sinks.values())

    def fail_all(self, error: Exception) -> None:
        """Hand `error` to every open request and forget them all."""
        sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            sink(error)


def step_and_deliver(core: EngineCore, outbox: Outbox) -> None:
    """One engine step in this thread, its deltas delivered (the `LLM` class's loop body)."""
    outbox.deliver(core.step())
