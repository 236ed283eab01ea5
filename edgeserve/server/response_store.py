"""Background responses kept in memory: each one's response object as of now and its numbered stream events, so a
client can poll it, read its stream from any event on (resume after a disconnect), or cancel it.

The store is bounded: at most `capacity` responses, finished ones dropped after `ttl` seconds or, when room is
needed, oldest first; when every slot holds a running response a new one is refused (429)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import anyio

from edgeserve.server.errors import APIError

TERMINAL = ("completed", "incomplete", "failed", "cancelled")


@dataclass
class StoredResponse:
    """One background response: its latest response object, its stream events so far, and how to stop it."""

    id: str
    snapshot: dict[str, Any]
    events: list[dict[str, Any]] = field(default_factory=list)  # SSE dicts; events[i] has sequence number i
    finished_at: float | None = None
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)  # the run's; cancel() stops it
    followers: int = 0  # clients reading its events now
    _unwatched_since: float | None = field(default_factory=time.monotonic)
    _changed: anyio.Event = field(default_factory=anyio.Event)

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    def add(self, event: dict[str, Any]) -> None:
        """Append the next stream event; its SSE id is `ID/N` (N: its sequence number), which a Last-Event-ID
        reconnect sends back."""
        self.events.append({**event, "id": f"{self.id}/{len(self.events)}"})
        self._notify()

    def update(self, snapshot: dict[str, Any]) -> None:
        """The response object as of now; a terminal status finishes the response."""
        self.snapshot = snapshot
        if snapshot["status"] in TERMINAL and self.finished_at is None:
            self.finished_at = time.monotonic()
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def changed(self) -> None:
        """Wait for the next event or change of state."""
        await self._changed.wait()

    def unwatched_for(self) -> float | None:
        """Seconds since the last client stopped following it (None while one follows)."""
        return None if self._unwatched_since is None else time.monotonic() - self._unwatched_since

    async def finished(self) -> None:
        """Wait until the response has finished (its run recorded the end)."""
        while not self.done:
            await self._changed.wait()

    async def follow(self, after: int = -1) -> AsyncIterator[dict[str, Any]]:
        """The events numbered after `after`, those to come included, until the response finishes."""
        i = after + 1
        self.followers += 1
        self._unwatched_since = None
        try:
            while True:
                while i < len(self.events):
                    yield self.events[i]
                    i += 1
                if self.done:
                    return
                await self._changed.wait()
        finally:
            self.followers -= 1
            if not self.followers:
                self._unwatched_since = time.monotonic()
                self._notify()


class ResponseStore:
    """Background responses by id, bounded in number and in how long finished ones stay."""

    def __init__(self, capacity: int, ttl: float) -> None:
        self.capacity, self.ttl = capacity, ttl
        self._items: dict[str, StoredResponse] = {}  # insertion order: oldest first

    def add(self, entry: StoredResponse) -> None:
        """Keep `entry`, making room by dropping finished responses (expired ones, then the oldest); 429 when
        every slot holds a running one."""
        self._expire()
        if len(self._items) >= self.capacity:
            oldest = next((k for k, v in self._items.items() if v.done), None)
            if oldest is None:
                raise APIError(429, f"{self.capacity} background responses and resumable streams are running; "
                               "retry when one finishes, or cancel one", "rate_limit_error", None,
                               "too_many_background_responses", {"Retry-After": "1"})
            del self._items[oldest]
        self._items[entry.id] = entry

    def get(self, response_id: str) -> StoredResponse:
        """The response `response_id`; 404 when it is unknown, deleted or expired."""
        self._expire()
        entry = self._items.get(response_id)
        if entry is None:
            raise APIError(404, f"no response with id {response_id!r}: only background responses are stored, and a "
                           f"finished one is kept for {self.ttl:g} s (at most {self.capacity} in all)",
                           "invalid_request_error", "response_id", "not_found")
        return entry

    def remove(self, response_id: str) -> StoredResponse:
        """Forget `response_id` (404 when unknown), cancelling it if it still runs."""
        entry = self.get(response_id)
        entry.scope.cancel()
        del self._items[response_id]
        return entry

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, v in self._items.items() if v.done and now - v.finished_at > self.ttl]:
            del self._items[key]
