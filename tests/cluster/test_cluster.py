"""`edgeserve cluster` end to end (issue 38): a local Ray instance, 2 replicas of the default model behind the
ingress; streaming for every API, prefix affinity, per-replica routes, the API key, a killed replica, shutdown."""

from __future__ import annotations

import httpx
import psutil
import pytest

from edgeserve.engine.config import EngineConfig
from edgeserve.registry import DEFAULT_MODEL
from edgeserve.server.config import ServerConfig
from tests.server_helpers import serve_app, wait_until

KEY = "cluster-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}
SYSTEM = "You are a meticulous assistant for a home lab. " + " ".join(
    f"Rule {i}: keep answers short, name the command, and say what it changes." for i in range(12))
EMBEDDER = "all-minilm"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(default_model_path):
    from edgeserve.cluster import launch
    from edgeserve.registry import pull

    pull(EMBEDDER, progress=False)
    config = ServerConfig(models=(DEFAULT_MODEL, EMBEDDER), api_key=KEY, max_loaded_models=2,
                          engine=EngineConfig(kv_cache_gb=0.05, max_num_seqs=4, max_num_batched_tokens=256))
    deployed = launch.start(config, launch.ClusterConfig(replicas=2, num_cpus=0.5, ray_init={"num_cpus": 2}))
    state = {"deployed": deployed, "stopped": False, "seen": set()}
    try:
        with serve_app(deployed.ingress) as running:
            state["url"] = running.url
            yield state
    finally:
        if not state["stopped"]:
            launch.stop(deployed)


def post(state, path: str, body: dict, **kw) -> httpx.Response:
    r = httpx.post(state["url"] + path, json=body, headers=kw.pop("headers", AUTH), timeout=120, **kw)
    if "x-edgeserve-replica" in r.headers:
        state["seen"].add(r.headers["x-edgeserve-replica"])
    return r


def cached_tokens(state) -> dict[str, float]:
    """edgeserve_cached_prompt_tokens_total per replica, from the ingress's merged /metrics."""
    text = httpx.get(state["url"] + "/metrics", headers=AUTH, timeout=60).text
    out = {}
    for line in text.splitlines():
        if line.startswith("edgeserve_cached_prompt_tokens_total{"):
            rid = line.split('replica="', 1)[1].split('"', 1)[0]
            out[rid] = out.get(rid, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def chat_body(question: str, **extra) -> dict:
    return {"model": DEFAULT_MODEL, "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}], **extra}


STREAMS = {  # path -> (body, how a streamed line of it looks)
    "/v1/chat/completions": ({**chat_body("Say hi."), "stream": True}, "data: "),
    "/v1/completions": ({"model": DEFAULT_MODEL, "prompt": "Once upon a time", "max_tokens": 6, "stream": True},
                        "data: "),
    "/api/chat": ({"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Say hi."}],
                   "options": {"num_predict": 6}}, '{"model"'),
    "/api/generate": ({"model": DEFAULT_MODEL, "prompt": "Once upon a time", "options": {"num_predict": 6}},
                      '{"model"'),
    "/v1/messages": ({"model": DEFAULT_MODEL, "max_tokens": 6, "stream": True,
                      "messages": [{"role": "user", "content": "Say hi."}]}, "data: "),
    "/v1/responses": ({"model": DEFAULT_MODEL, "input": "Say hi.", "max_output_tokens": 6, "stream": True},
                      "data: "),
}


@pytest.mark.parametrize("path", list(STREAMS))
def test_every_api_streams_through_the_ingress(cluster, path):
    body, prefix = STREAMS[path]
    with httpx.stream("POST", cluster["url"] + path, json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200, r.read()
        cluster["seen"].add(r.headers["x-edgeserve-replica"])
        chunks = [line for line in r.iter_lines() if line.startswith(prefix)]
    assert len(chunks) >= 3  # several events, not one buffered body


def test_embeddings_through_the_ingress(cluster):
    r = post(cluster, "/v1/embeddings", {"model": EMBEDDER, "input": ["a home lab", "a garden"]})
    assert r.status_code == 200, r.text
    assert len(r.json()["data"]) == 2 and len(r.json()["data"][0]["embedding"]) > 0


def test_shared_prefix_lands_on_one_replica_and_hits_its_cache(cluster):
    before = cached_tokens(cluster)
    replicas = [post(cluster, "/v1/chat/completions", chat_body(f"Question {i}: what does `ls -l` show?"))
                for i in range(3)]
    assert all(r.status_code == 200 for r in replicas)
    home = {r.headers["x-edgeserve-replica"] for r in replicas}
    assert len(home) == 1
    (home,) = home
    # a conversation's next turn follows it too
    turn2 = chat_body("Question 0: what does `ls -l` show?")
    turn2["messages"] += [{"role": "assistant", "content": replicas[0].json()["choices"][0]["message"]["content"]},
                          {"role": "user", "content": "And `ls -a`?"}]
    assert post(cluster, "/v1/chat/completions", turn2).headers["x-edgeserve-replica"] == home
    after = cached_tokens(cluster)
    system_tokens = len(SYSTEM) // 6  # well under the system prompt's real token count
    assert after[home] - before.get(home, 0) >= 3 * system_tokens
    for other, value in after.items():
        if other != home:
            assert value == before.get(other, 0)
    cluster["home"] = home


def test_a_cold_prefix_goes_to_the_other_replica_and_ps_lists_both(cluster):
    r = post(cluster, "/v1/chat/completions", {**chat_body("Hi."), "messages": [
        {"role": "system", "content": "You write haiku about network cables. " * 12},
        {"role": "user", "content": "One about a patch panel."}]})
    assert r.status_code == 200
    assert len(cluster["seen"]) == 2
    ps = httpx.get(cluster["url"] + "/api/ps", headers=AUTH, timeout=60).json()["models"]
    assert {m["replica"] for m in ps} == cluster["seen"]
    assert {m["name"] for m in ps} <= {DEFAULT_MODEL, EMBEDDER}
    health = httpx.get(cluster["url"] + "/health", timeout=60).json()
    assert set(health["replicas"]) == cluster["seen"] and health["models"][DEFAULT_MODEL] == "loaded"


def test_the_api_key_holds(cluster):
    url = cluster["url"]
    assert post(cluster, "/v1/chat/completions", chat_body("hi"), headers={}).status_code == 401
    bad = post(cluster, "/v1/messages", {"model": DEFAULT_MODEL, "messages": []}, headers={"x-api-key": "wrong"})
    assert bad.status_code == 401 and bad.json()["type"] == "error"  # in the route's own error shape
    assert httpx.get(url + "/metrics", timeout=30).status_code == 401
    ps = httpx.get(url + "/api/ps", timeout=30)
    assert ps.status_code == 401 and "API key" in ps.json()["error"]  # Ollama's error shape
    assert httpx.get(url + "/health", timeout=60).status_code == 200


def running_requests(state) -> float:
    """edgeserve_num_requests_running summed over the replicas."""
    text = httpx.get(state["url"] + "/metrics", headers=AUTH, timeout=60).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("edgeserve_num_requests_running{"))


def test_limits_and_the_chat_page_hold_at_the_ingress(cluster):
    big = post(cluster, "/v1/chat/completions", chat_body("x" * (ServerConfig().max_body_bytes + 1)))
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    page = httpx.get(cluster["url"] + "/", timeout=60)
    assert page.status_code == 200 and "<html" in page.text.lower() and "x-edgeserve-replica" in page.headers
    bad = post(cluster, "/api/chat", {"model": DEFAULT_MODEL, "messages": "not a list"})
    assert bad.status_code == 400 and "error" in bad.json()  # the replica's own validation, Ollama's shape


def test_a_client_that_goes_away_cancels_the_request_on_its_replica(cluster):
    body = {**chat_body("Count from one to a thousand in words."), "max_tokens": 1800, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", cluster["url"] + "/v1/chat/completions", json=body, headers=AUTH, timeout=120) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert running_requests(cluster) == 1
    # the rest of the 1800 tokens takes ~20 s here (uncancelled, measured): the request ended because the client left
    assert wait_until(lambda: running_requests(cluster) == 0, timeout=3, interval=0.1)


def test_a_background_response_is_found_on_the_replica_that_holds_it(cluster):
    """Each replica stores its own background responses: polls, a streamed resume and a cancel by id all reach the
    replica that answered the create, whichever the router would pick by load."""
    created = post(cluster, "/v1/responses", {"model": DEFAULT_MODEL, "input": "Say hi.", "max_output_tokens": 6,
                                              "background": True})
    assert created.status_code == 200, created.text
    rid, home = created.json()["id"], created.headers["x-edgeserve-replica"]
    for _ in range(6):  # by load alone, 6 polls would not all land on one of two replicas
        r = httpx.get(f"{cluster['url']}/v1/responses/{rid}", headers=AUTH, timeout=60)
        assert r.status_code == 200 and r.headers["x-edgeserve-replica"] == home and r.json()["id"] == rid

    def done() -> bool:
        got = httpx.get(f"{cluster['url']}/v1/responses/{rid}", headers=AUTH, timeout=60).json()
        return got["status"] not in ("queued", "in_progress")

    assert wait_until(done, timeout=60, interval=0.2)
    with httpx.stream("GET", f"{cluster['url']}/v1/responses/{rid}?stream=true&starting_after=0", headers=AUTH,
                      timeout=60) as r:
        assert r.status_code == 200 and r.headers["x-edgeserve-replica"] == home
        assert any(line.startswith("data: ") for line in r.iter_lines())
    gone = httpx.delete(f"{cluster['url']}/v1/responses/{rid}", headers=AUTH, timeout=60)
    assert gone.status_code == 200 and gone.headers["x-edgeserve-replica"] == home


def test_a_killed_replicas_requests_go_to_the_other(cluster):
    import ray
    from ray import serve

    home = cluster["home"]  # the replica holding SYSTEM (the affinity test)
    ray.kill(ray.get_actor(f"SERVE_REPLICA::edgeserve#EdgeserveReplica#{home}", namespace="serve"))
    r = post(cluster, "/v1/chat/completions", chat_body("Question 9: what does `ls -l` show?"))
    assert r.status_code == 200, r.text
    assert r.headers["x-edgeserve-replica"] != home

    def two_running() -> bool:
        states = serve.status().applications["edgeserve"].deployments["EdgeserveReplica"].replica_states
        return states.get("RUNNING", 0) == 2

    assert wait_until(two_running, timeout=120, interval=0.5)  # Ray starts a new replica in its place
    assert wait_until(lambda: len(httpx.get(cluster["url"] + "/health", timeout=60).json()["replicas"]) == 2,
                      timeout=60, interval=0.5)


def test_shutdown_leaves_no_ray_process(cluster):
    from edgeserve.cluster import launch

    ray_procs = [p for p in psutil.Process().children(recursive=True)]
    assert any("raylet" in " ".join(p.cmdline()) for p in ray_procs)
    cluster["stopped"] = True
    launch.stop(cluster["deployed"])
    _, alive = psutil.wait_procs(ray_procs, timeout=60)
    assert alive == []
