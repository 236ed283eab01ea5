"""What the ingress sends a replica and what streams back (plain picklable dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ForwardedRequest:
    """One HTTP request as the ingress read it, with its routing key.

    `prefix` is route_key's chained hashes (empty: route by load); `replica`: the replica it must reach (it names a
    response or a running request that one holds: cluster.owners), None when any may take it.
    """

    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    prefix: tuple[int, ...] = ()
    replica: str | None = None


@dataclass(frozen=True)
class ResponseStart:
    """The first item a replica streams back: its id, the status and the headers; body chunks (bytes) follow."""

    replica: str
    status: int
    headers: tuple[tuple[bytes, bytes], ...]
