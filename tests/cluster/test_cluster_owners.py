"""The ingress sends a request that names a response or a running request to the replica holding it
(edgeserve/cluster/owners.py); no Ray needed."""

from __future__ import annotations

from edgeserve.cluster.owners import ReplicaOwners, addressed_id, request_id


def test_request_ids_are_unique_and_keep_a_clients_id():
    assert request_id("my-req") != request_id("my-req") and request_id("my-req").startswith("my-req.")
    assert request_id(None).startswith("es") and request_id("bad id with spaces").startswith("es")


def test_which_requests_address_an_id():
    assert addressed_id("/v1/responses/resp_abc123", None) == "resp_abc123"
    assert addressed_id("/v1/responses/resp_abc123/cancel", None) == "resp_abc123"
    assert addressed_id("/v1/requests/chatcmpl-x9/end_thinking", None) == "chatcmpl-x9"
    assert addressed_id("/v1/chat/completions", "chatcmpl-x9/12") == "chatcmpl-x9"  # a Last-Event-ID reconnect
    assert addressed_id("/v1/responses", None) is None and addressed_id("/v1/chat/completions", "7") is None


def test_an_id_built_on_a_request_id_finds_the_replica_that_answered_it():
    owners = ReplicaOwners(limit=3)
    a, b = request_id(None), request_id("client")
    owners.answered(a, "replica-1")
    owners.answered(b, "replica-2")
    assert owners.owner_of(f"resp_{a}1f2e3d4c") == "replica-1"
    assert owners.owner_of(f"chatcmpl-{b}-0") == "replica-2"
    assert owners.owner_of("resp_unknown") is None
    for i in range(3):  # bounded: the oldest is forgotten first
        owners.answered(request_id(None), f"r{i}")
    assert owners.owner_of(f"resp_{a}1f2e3d4c") is None
