"""What the ingress sends a replica and what streams back (plain picklable dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ForwardedRequest:
    """One HTTP request as the ingress read it, with its routing key.

    `prefix` is route_key's chained hashes (empty: route by load).
    """

    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    prefix: tuple[int, ...] = ()


@dataclass(frozen=True)
class ResponseStart:
    """The first item a replica streams back: its id, the status and the headers; body chunks (bytes) follow."""

    replica: str
    status: int
    headers: tuple[tuple[bytes, bytes], ...]
