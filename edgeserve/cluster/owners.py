"""Which replica holds what a request addresses by id: a background response, a resumable stream, a running
request whose thinking a client ends. Each replica keeps those in its own process, so the ingress gives every
request a request id of its own, learns which replica answered it, and sends a later request that names an id
built on that request id (`resp_<rid>...`, `chatcmpl-<rid>...`, or `Last-Event-ID: <that id>/N`) to the same replica.
"""

from __future__ import annotations

import re
import secrets
from collections import OrderedDict

# the paths that name a stored response or a running request (GET / DELETE a response, cancel, end thinking)
_ADDRESSED = re.compile(r"^/v1/(?:responses|requests)/([A-Za-z0-9._-]+)(?:/(?:cancel|end_thinking|input_items))?$")
_CLIENT_RID = re.compile(r"^[A-Za-z0-9._-]{1,40}$")
MAX_OWNERS = 65_536  # request ids remembered, least recent first out (far more than a store keeps)


def request_id(client_rid: str | None) -> str:
    """A request id unique to this ingress, keeping a well-formed client X-Request-Id as its start (for logs)."""
    tail = secrets.token_hex(6)
    return f"{client_rid}.{tail}" if client_rid and _CLIENT_RID.match(client_rid) else f"es{tail}"


def addressed_id(path: str, last_event_id: str | None) -> str | None:
    """The id a request names, whose replica it must reach: a response / request id in its path, or the stream id
    of a `Last-Event-ID: ID/N` reconnect; None for any other request."""
    m = _ADDRESSED.match(path)
    if m is not None:
        return m.group(1)
    if last_event_id and "/" in last_event_id:
        return last_event_id.rsplit("/", 1)[0] or None
    return None


class ReplicaOwners:
    """Request id -> the replica that answered it, for the last MAX_OWNERS requests."""

    def __init__(self, limit: int = MAX_OWNERS) -> None:
        self.limit = limit
        self._owner: OrderedDict[str, str] = OrderedDict()

    def answered(self, rid: str, replica: str) -> None:
        """Remember that `replica` answered request `rid`."""
        self._owner[rid] = replica
        self._owner.move_to_end(rid)
        while len(self._owner) > self.limit:
            self._owner.popitem(last=False)

    def owner_of(self, addressed: str) -> str | None:
        """The replica holding what `addressed` (an id built on one of our request ids) names; None when unknown."""
        best = None
        for rid, replica in self._owner.items():
            if rid in addressed and (best is None or len(rid) > len(best[0])):
                best = (rid, replica)
        return best[1] if best else None
