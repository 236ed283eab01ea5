"""PrefixAffinityRouter: Ray Serve's request router for edgeserve replicas (runs in the ingress process)."""

from __future__ import annotations

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (LocalityMixin, MultiplexMixin, PendingRequest, ReplicaID, RequestRouter,
                                      RunningReplica)

from edgeserve.cluster.affinity import DEFAULT_MAX_IMBALANCE, AffinityTable, rank_replicas
from edgeserve.cluster.wire import ForwardedRequest


def _forwarded(pending: PendingRequest | None) -> ForwardedRequest | None:
    if pending is None or not pending.args or not isinstance(pending.args[0], ForwardedRequest):
        return None
    return pending.args[0]


class PrefixAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Sends a request to the replica that was sent its longest prefix unless that one is overloaded, else to the
    least loaded; `affinity=False` is Ray's power-of-two choices (the benchmark's baseline)."""

    def initialize_state(self, affinity: bool = True, max_imbalance: int = DEFAULT_MAX_IMBALANCE) -> None:
        """Router options (request_router_kwargs)."""
        self._affinity, self._max_imbalance = affinity, max_imbalance
        self._table = AffinityTable()

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        ids = {r.replica_id.unique_id for r in replicas}
        for gone in set(self._table.owned) - ids:
            self._table.forget(gone)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._table.forget(replica_id.unique_id)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        req = _forwarded(pending_request)
        if req is None or not self._affinity or not req.prefix:
            return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        lens = await self._queue_lens(candidate_replicas)
        if not lens:  # no replica answered a probe: let power-of-two choices retry with its backoff
            return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)
        return [[by_id[r]] for r in rank_replicas(self._table, req.prefix, lens, self._max_imbalance)]

    async def _queue_lens(self, replicas: list[RunningReplica]) -> dict[str, int]:
        """Requests in flight per replica: from Ray's cache, probing the replicas it has no fresh entry for."""
        lens: dict[str, int] = {}
        missing = []
        for r in replicas:
            n = self._replica_queue_len_cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
            if n is None:
                missing.append(r)
            else:
                lens[r.replica_id.unique_id] = n
        if missing:
            for r, n in await self._probe_queue_lens(missing, 0):
                if n is not None:
                    lens[r.replica_id.unique_id] = n
        return lens

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        req = _forwarded(pending_request)
        if req is not None and req.prefix and self._affinity:
            self._table.record(req.prefix, replica_id.unique_id)
