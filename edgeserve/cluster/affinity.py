"""AffinityTable: which replica was last sent each prefix hash, and the routing choice made from it (no Ray here)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

DEFAULT_MAX_IMBALANCE = 4  # requests: the cached replica is skipped when it has this many more in flight than the least
MIN_MATCH_FRACTION = 0.1  # a match shorter than this share of the prompt is no reason to prefer a replica


@dataclass
class AffinityTable:
    """A bounded LRU map from prefix hash to the replica that holds it, with each replica's hash count.

    The router writes every routed request's hashes under the replica it went to; since a hash names a whole
    prefix, the deepest hash found names the replica with the longest cached prefix.
    """

    capacity: int = 200_000
    owner: OrderedDict[int, str] = field(default_factory=OrderedDict)
    owned: dict[str, int] = field(default_factory=dict)

    def match(self, hashes: tuple[int, ...], alive: set[str]) -> tuple[str | None, int]:
        """The replica (among `alive`) holding the longest prefix of `hashes`, and how many hashes it holds."""
        for depth in range(len(hashes), 0, -1):  # hashes chain: the deepest one held is the longest prefix
            rid = self.owner.get(hashes[depth - 1])
            if rid is not None and rid in alive:
                return rid, depth
        return None, 0

    def record(self, hashes: tuple[int, ...], replica: str) -> None:
        """Note that `replica` now holds every prefix in `hashes` (most recently used)."""
        for h in hashes:
            old = self.owner.pop(h, None)
            if old is not None:
                self.owned[old] -= 1
            self.owner[h] = replica
            self.owned[replica] = self.owned.get(replica, 0) + 1
        while len(self.owner) > self.capacity:
            _, old = self.owner.popitem(last=False)
            self.owned[old] -= 1

    def forget(self, replica: str) -> None:
        """Drop a replica that is gone: its prefixes are owned by nobody."""
        for h in [h for h, r in self.owner.items() if r == replica]:
            del self.owner[h]
        self.owned.pop(replica, None)


def rank_replicas(table: AffinityTable, hashes: tuple[int, ...], queue_lens: dict[str, int],
                  max_imbalance: int = DEFAULT_MAX_IMBALANCE) -> list[str]:
    """Replica ids best first: the one holding the longest prefix unless it has more than `max_imbalance` requests
    in flight above the least loaded one; then by load, ties to the replica holding fewer prefixes (spreads cold
    prefixes). `queue_lens` maps every live replica to its requests in flight."""
    by_load = sorted(queue_lens, key=lambda r: (queue_lens[r], table.owned.get(r, 0), r))
    if not by_load:
        return []
    owner, depth = table.match(hashes, set(queue_lens))
    if owner is not None and depth >= max(1, MIN_MATCH_FRACTION * len(hashes)) and \
            queue_lens[owner] - queue_lens[by_load[0]] <= max_imbalance:
        return [owner, *[r for r in by_load if r != owner]]
    return by_load


@dataclass
class InFlight:
    """Requests routed and not yet completed, per replica, counted from the moment of the choice (before Ray sends
    the request), so that requests routed at the same moment see each other's choices."""

    count: dict[str, int] = field(default_factory=dict)
    where: dict[str, str] = field(default_factory=dict)  # request id -> replica

    def reserve(self, request_id: str, replica: str) -> None:
        """Count `request_id` on `replica` (moving it if it was counted elsewhere)."""
        self.release(request_id)
        self.where[request_id] = replica
        self.count[replica] = self.count.get(replica, 0) + 1

    def release(self, request_id: str) -> None:
        """The request completed (or is being routed again)."""
        replica = self.where.pop(request_id, None)
        if replica is not None:
            self.count[replica] -= 1

    def forget(self, replica: str) -> None:
        """Drop a replica that is gone, with its requests."""
        self.count.pop(replica, None)
        self.where = {k: v for k, v in self.where.items() if v != replica}


@dataclass
class AffinityRouting:
    """The prefix-affinity policy's whole state: where prefixes went and what is in flight where."""

    max_imbalance: int = DEFAULT_MAX_IMBALANCE
    table: AffinityTable = field(default_factory=AffinityTable)
    inflight: InFlight = field(default_factory=InFlight)

    def choose(self, request_id: str, hashes: tuple[int, ...], replicas: list[str]) -> list[str]:
        """Rank `replicas` (the live ones) for a request, best first, and count it on the first at once."""
        ranked = rank_replicas(self.table, hashes, {r: self.inflight.count.get(r, 0) for r in replicas},
                               self.max_imbalance)
        if ranked:
            self.routed(request_id, hashes, ranked[0])
        return ranked

    def routed(self, request_id: str, hashes: tuple[int, ...], replica: str) -> None:
        """The request went to `replica` (a later rank when the first was full): count and record it there."""
        if self.inflight.where.get(request_id) != replica:
            self.inflight.reserve(request_id, replica)
            self.table.record(hashes, replica)

    def completed(self, request_id: str) -> None:
        """The request's reply ended (or failed)."""
        self.inflight.release(request_id)

    def forget(self, replica: str) -> None:
        """A replica is gone."""
        self.table.forget(replica)
        self.inflight.forget(replica)
