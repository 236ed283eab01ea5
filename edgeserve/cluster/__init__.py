"""edgeserve replicas on Ray Serve: one HTTP ingress, N replicas, prefix-affinity routing (docs/CLUSTER.md).

Ray is optional (`pip install edgeserve[cluster]`); only `launch`, `replica` and `router` import it.
"""
