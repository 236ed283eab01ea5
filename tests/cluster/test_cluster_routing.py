"""The cluster's routing key, affinity table and merged answers (edgeserve/cluster/), without Ray."""

from __future__ import annotations

import json

from edgeserve.cluster.affinity import AffinityTable, rank_replicas
from edgeserve.cluster.aggregate import merge_health, merge_metrics, merge_ps
from edgeserve.cluster.route_key import CHUNK_CHARS, chunk_hashes, route_key

SYSTEM = "You are a terse assistant. " * 20


def chat(*turns: str, system: str = SYSTEM, model: str = "m") -> bytes:
    msgs = [{"role": "system", "content": system}]
    for i, t in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return json.dumps({"model": model, "messages": msgs}).encode()


def test_next_turn_extends_the_previous_turns_key():
    first = route_key("/v1/chat/completions", chat("What is 2+2?"))
    second = route_key("/v1/chat/completions", chat("What is 2+2?", "4", "And 3+3?"))
    assert len(first) >= len(SYSTEM) // CHUNK_CHARS
    assert second[:len(first) - 1] == first[:-1]  # all but the chunk cut by the turn's end
    assert len(second) > len(first)


def test_shared_system_prompt_shares_leading_hashes_and_models_do_not():
    a = route_key("/v1/chat/completions", chat("one question, " * 20))
    b = route_key("/api/chat", chat("another question, " * 20))
    assert a[:5] == b[:5] and a != b
    assert route_key("/v1/chat/completions", chat("one question, " * 20, model="other"))[0] != a[0]


def test_every_api_shape_has_a_key():
    anthropic = json.dumps({"model": "m", "system": SYSTEM, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}]}]}).encode()
    responses = json.dumps({"model": "m", "instructions": SYSTEM, "input": "hi"}).encode()
    generate = json.dumps({"model": "m", "prompt": SYSTEM + "hi"}).encode()
    for path, body in [("/v1/messages", anthropic), ("/v1/responses", responses), ("/api/generate", generate),
                       ("/v1/completions", generate)]:
        assert len(route_key(path, body)) >= len(SYSTEM) // CHUNK_CHARS, path


def test_other_routes_and_bad_bodies_route_by_load():
    assert route_key("/api/tags", b"") == ()
    assert route_key("/v1/chat/completions", b"{not json") == ()
    assert route_key("/v1/chat/completions", b"[1, 2]") == ()
    assert chunk_hashes("x" * (CHUNK_CHARS - 1)) == ()


def test_the_replica_holding_the_prefix_wins_until_it_is_overloaded():
    table = AffinityTable()
    key = chunk_hashes(SYSTEM + "question")
    table.record(key, "b")
    assert rank_replicas(table, key, {"a": 0, "b": 0})[0] == "b"
    assert rank_replicas(table, key, {"a": 0, "b": 4}, max_imbalance=4)[0] == "b"
    assert rank_replicas(table, key, {"a": 0, "b": 5}, max_imbalance=4)[0] == "a"
    # a longer conversation of the same prefix follows it
    assert rank_replicas(table, chunk_hashes(SYSTEM + "question, and more of it" * 5), {"a": 1, "b": 2})[0] == "b"


def test_a_dead_replica_is_routed_around_and_forgotten():
    table = AffinityTable()
    key = chunk_hashes(SYSTEM)
    table.record(key, "b")
    assert rank_replicas(table, key, {"a": 3}) == ["a"]  # b is not among the live replicas
    table.forget("b")
    assert table.match(key, {"a", "b"}) == (None, 0) and "b" not in table.owned


def test_cold_prefixes_spread_over_replicas():
    table = AffinityTable()
    k1, k2 = chunk_hashes("first " * 40), chunk_hashes("second " * 40)
    first = rank_replicas(table, k1, {"a": 0, "b": 0})[0]
    table.record(k1, first)
    second = rank_replicas(table, k2, {"a": 0, "b": 0})[0]
    assert second != first


def test_table_stays_within_capacity():
    table = AffinityTable(capacity=10)
    table.record(chunk_hashes("y" * CHUNK_CHARS * 30), "a")
    assert len(table.owner) == 10 and table.owned["a"] == 10


def test_metrics_are_labelled_by_replica_with_one_help_per_family():
    text = ("# HELP req_total Requests\n# TYPE req_total counter\nreq_total{model=\"m\"} 3.0\n"
            "# HELP up Up\n# TYPE up gauge\nup 1.0\n")
    merged = merge_metrics({"r1": text, "r2": text.replace("3.0", "5.0")})
    lines = merged.splitlines()
    assert lines.count("# HELP req_total Requests") == 1
    i = lines.index("# TYPE req_total counter")
    assert lines[i + 1:i + 3] == ['req_total{replica="r1",model="m"} 3.0', 'req_total{replica="r2",model="m"} 5.0']
    assert 'up{replica="r2"} 1.0' in lines


def test_ps_and_health_list_every_replica():
    ps = merge_ps({"r1": {"models": [{"name": "m"}]}, "r2": {"models": [{"name": "m"}]}})
    assert [m["replica"] for m in ps["models"]] == ["r1", "r2"]
    status, body = merge_health({"r1": {"models": {"m": "loaded"}}, "r2": {"models": {"m": "not loaded"}}})
    assert status == 200 and body["models"] == {"m": "loaded"} and set(body["replicas"]) == {"r1", "r2"}
    assert merge_health({})[0] == 503


def test_cluster_without_ray_says_how_to_install(monkeypatch, capsys):
    import builtins

    from edgeserve.cli import main

    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    assert main(["cluster", "--port", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["edgeserve: error: edgeserve cluster needs Ray Serve: pip install 'edgeserve[cluster]'"]


def test_cluster_flags_are_checked(capsys):
    from edgeserve.cli import main

    assert main(["cluster", "--replicas", "0"]) == 1
    assert "replicas must be a positive integer" in capsys.readouterr().err


def test_requests_arriving_together_spread_and_group_by_prefix():
    from edgeserve.cluster.affinity import AffinityRouting

    policy = AffinityRouting(max_imbalance=4)
    prompts = [chunk_hashes(f"system prompt {p}: " + "be brief. " * 60) for p in range(2)]
    went = {c: policy.choose(f"r{c}", prompts[c % 2], ["a", "b"])[0] for c in range(8)}  # none completes yet
    assert {went[c] for c in range(0, 8, 2)} != {went[c] for c in range(1, 8, 2)}  # one replica per prompt
    assert all(len({went[c] for c in range(p, 8, 2)}) == 1 for p in range(2))
    assert policy.inflight.count == {"a": 4, "b": 4}
    for c in range(8):
        policy.completed(f"r{c}")
    assert policy.inflight.count == {"a": 0, "b": 0}


def test_a_busy_prefix_holder_overflows_to_the_other_replica():
    from edgeserve.cluster.affinity import AffinityRouting

    policy = AffinityRouting(max_imbalance=2)
    key = chunk_hashes(SYSTEM)
    went = [policy.choose(f"r{i}", key, ["a", "b"])[0] for i in range(5)]
    assert went[:3] == [went[0]] * 3 and went[3] != went[0]  # 3 in flight vs 0: more than 2 above the least
    policy.routed("r4", key, "b")  # Ray took a later rank: the request counts where it went
    assert policy.inflight.where["r4"] == "b"
