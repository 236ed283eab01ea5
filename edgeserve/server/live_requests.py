"""The generations running now, by the ids a client knows them by: its request id (the `X-Request-Id` it sent, or
the one every reply carries in that header) and its reply's id (`chatcmpl-...`, `cmpl-...`, `resp_...`,
`msg_...`). Routes that act on a running request (end its thinking) look it up here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgeserve.server.errors import APIError

if TYPE_CHECKING:
    from edgeserve.server.generation import Generation


class LiveRequests:
    """Running generations by id; a generation leaves when it closes."""

    def __init__(self) -> None:
        self._by_id: dict[str, list["Generation"]] = {}

    def add(self, gen: "Generation", ids: set[str]) -> None:
        """Register `gen` under each of `ids` until it closes."""
        for key in ids:
            self._by_id.setdefault(key, []).append(gen)
        gen.on_close.append(lambda: self._remove(gen, ids))

    def find(self, key: str) -> list["Generation"]:
        """The generations running under `key`; 404 when none does."""
        gens = self._by_id.get(key)
        if not gens:
            raise APIError(404, f"no running request with id {key!r} (give the X-Request-Id of the request or its "
                           "reply's id while it runs)", "invalid_request_error", "id", "not_found")
        return list(gens)

    def _remove(self, gen: "Generation", ids: set[str]) -> None:
        for key in ids:
            gens = self._by_id.get(key, [])
            if gen in gens:
                gens.remove(gen)
            if not gens:
                self._by_id.pop(key, None)
