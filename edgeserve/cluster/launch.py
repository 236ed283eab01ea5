"""Start (or join) a Ray cluster, deploy N edgeserve replicas behind the prefix-affinity router, and stop them."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from edgeserve.cluster.affinity import DEFAULT_MAX_IMBALANCE
from edgeserve.errors import EdgeserveError, config_error
from edgeserve.server.config import ServerConfig, _flag

INSTALL_HINT = "edgeserve cluster needs Ray Serve: pip install 'edgeserve[cluster]'"
DEPLOYMENT = "EdgeserveReplica"


@dataclass(frozen=True)
class ClusterConfig:
    """Where the replicas run and how requests reach them.

    `address`: None starts a Ray instance on this machine; "auto" or HOST:PORT joins a running cluster (`ray start`).
    `routing`: "prefix" (PrefixAffinityRouter) or "pow2" (Ray's power-of-two choices, for comparison).
    """

    address: str | None = _flag(None, "--address")
    replicas: int = _flag(2, "--replicas")
    num_cpus: float = _flag(1.0, "--num-cpus")  # per replica
    num_gpus: float = _flag(0.0, "--num-gpus")  # per replica
    routing: str = _flag("prefix", "--routing")
    max_imbalance: int = _flag(DEFAULT_MAX_IMBALANCE, "--max-imbalance")
    app_name: str = "edgeserve"
    ray_init: dict[str, Any] = field(default_factory=dict)  # more ray.init arguments (tests: num_cpus)

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise config_error(ClusterConfig, "replicas", "be a positive integer", self.replicas)
        for name in ("num_cpus", "num_gpus"):
            if getattr(self, name) < 0:
                raise config_error(ClusterConfig, name, "be zero or more", getattr(self, name))
        if self.routing not in ("prefix", "pow2"):
            raise config_error(ClusterConfig, "routing", "be prefix or pow2", self.routing)
        if self.max_imbalance < 0:
            raise config_error(ClusterConfig, "max_imbalance", "be zero or more", self.max_imbalance)


def require_ray() -> None:
    """Raise the one-line install hint when Ray Serve is not installed (call it before Ray Serve is imported)."""
    # A replica busy prefilling on a loaded CPU answers the router's queue-length probe late; at Ray's default
    # deadline (0.1 s) the router reads that as "cannot take it" and sends a conversation to a replica without its
    # prefix. Ray reads this when ray.serve is first imported.
    os.environ.setdefault("RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S", "1.0")
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        raise EdgeserveError(INSTALL_HINT) from None


@dataclass
class Cluster:
    """A deployed cluster: its ingress app (serve it with uvicorn) and what `stop` needs."""

    ingress: Any
    handle: Any
    config: ClusterConfig
    local: bool  # this process started the Ray instance (else it joined one at `address`)


def start(server: ServerConfig, cluster: ClusterConfig) -> Cluster:
    """Deploy `cluster.replicas` replicas of `server`'s app on Ray and return the ingress; blocks until every
    replica is up (models still load lazily, on first request)."""
    require_ray()
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from edgeserve.cluster.ingress import ClusterIngress
    from edgeserve.cluster.replica import EdgeserveReplica
    from edgeserve.cluster.router import PrefixAffinityRouter

    if not ray.is_initialized():
        ray.init(address=cluster.address, include_dashboard=False, **cluster.ray_init)
    serve.start(proxy_location="Disabled")  # the ingress is this process's own HTTP server
    router = RequestRouterConfig(request_router_class=PrefixAffinityRouter, request_router_kwargs={
        "affinity": cluster.routing == "prefix", "max_imbalance": cluster.max_imbalance})
    engine = server.engine
    deployment = serve.deployment(EdgeserveReplica).options(
        name=DEPLOYMENT, num_replicas=cluster.replicas,
        ray_actor_options={"num_cpus": cluster.num_cpus, "num_gpus": cluster.num_gpus},
        # edgeserve queues and refuses (429) on its own: Ray must not hold requests back before it does
        max_ongoing_requests=engine.max_num_seqs + engine.max_waiting, request_router_config=router,
        # edgeserve logs each request itself; Ray's per-call access lines would double them
        logging_config={"log_level": server.log_level.upper(), "enable_access_log": False})
    handle = serve.run(deployment.bind(server), name=cluster.app_name, route_prefix=None)
    return Cluster(ClusterIngress(handle, server), handle, cluster, local=cluster.address is None)


def stop(cluster: Cluster) -> None:
    """Remove the replicas (they unload their models); a Ray instance this process started is shut down, a joined
    cluster keeps running (only this app is deleted)."""
    import ray
    from ray import serve

    if cluster.local:
        serve.shutdown()
    else:
        serve.delete(cluster.config.app_name)
    ray.shutdown()
