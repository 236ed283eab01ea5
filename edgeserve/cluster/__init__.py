"""edgeserve replicas on Ray Serve: one HTTP ingress, N replicas, prefix-affinity routing (docs/CLUSTER.md).

Ray is optional (`pip install edgeserve[cluster]`): `affinity`, `aggregate`, `route_key` and `wire` work without
it; `launch` imports it when called, `ingress`, `replica` and `router` at import.
"""
