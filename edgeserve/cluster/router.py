"""PrefixAffinityRouter: Ray Serve's request router for edgeserve replicas (runs in the ingress process)."""

from __future__ import annotations

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (LocalityMixin, MultiplexMixin, PendingRequest, ReplicaID, RequestRouter,
                                      RunningReplica)

from edgeserve.cluster.affinity import DEFAULT_MAX_IMBALANCE, AffinityRouting
from edgeserve.cluster.wire import ForwardedRequest


def _forwarded(pending: PendingRequest | None) -> ForwardedRequest | None:
    if pending is None or not pending.args or not isinstance(pending.args[0], ForwardedRequest):
        return None
    return pending.args[0]


class PrefixAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Sends a request to the replica that was sent its longest prefix unless that one is overloaded, else to the
    least loaded; `affinity=False` is Ray's power-of-two choices (the benchmark's baseline).

    Load is the requests this router has in flight per replica (the ingress is the replicas' only caller), counted
    from the moment of the choice, and a choice records its prefix at once: requests that arrive together spread
    over the replicas, and those sharing a new prefix follow the first one.
    """

    def initialize_state(self, affinity: bool = True, max_imbalance: int = DEFAULT_MAX_IMBALANCE) -> None:
        """Router options (request_router_kwargs)."""
        self._affinity = affinity
        self._policy = AffinityRouting(max_imbalance)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        ids = {r.replica_id.unique_id for r in replicas}
        for gone in (set(self._policy.table.owned) | set(self._policy.inflight.count)) - ids:
            self._policy.forget(gone)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._policy.forget(replica_id.unique_id)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        req = _forwarded(pending_request)
        pinned = [r for r in candidate_replicas if req is not None and r.replica_id.unique_id == req.replica]
        if pinned:  # it names something only that replica holds
            return [pinned]
        if req is None or not self._affinity or not req.prefix or not candidate_replicas:
            return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranked = self._policy.choose(pending_request.metadata.internal_request_id, req.prefix, list(by_id))
        return [[by_id[r]] for r in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        req = _forwarded(pending_request)
        if req is not None and req.prefix and self._affinity:
            self._policy.routed(pending_request.metadata.internal_request_id, req.prefix, replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._policy.completed(internal_request_id)
