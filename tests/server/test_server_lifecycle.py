"""Lazy load on first request (one load for concurrent first requests), keep-alive unload, reload, LRU eviction."""

from __future__ import annotations

import anyio
import httpx
import pytest

from edgeserve.server import ServerConfig
from edgeserve.engine.config import EngineConfig
from server_helpers import metric, serve, wait_until
from tiny_gguf import write_tiny_llama

CHAT = "/v1/chat/completions"


def chat(model: str, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0, **kw}


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("life")
    return write_tiny_llama(d / "tiny-a.gguf", seed=1), write_tiny_llama(d / "tiny-b.gguf", seed=2)


def loaded(c: httpx.Client) -> dict[str, str]:
    return {m["name"]: m["status"] for m in c.get("/api/ps").json()["models"]}


def load_count(c: httpx.Client, model: str) -> float:
    return metric(c.get("/metrics").text, "edgeserve_model_load_seconds_count", f'model="{model}"') or 0.0


def test_lazy_load_keep_alive_unload_and_reload(tiny_paths):
    with serve(ServerConfig(engine=EngineConfig(kv_cache_gb=0.01), models=(str(tiny_paths[0]),), keep_alive=0.5)) as s:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert loaded(c) == {}  # nothing loads at start
            assert c.get("/health").json() == {"status": "ok", "loading": False, "models": {"tiny-a": "not loaded"}}
            # (whether it is still loaded right after the reply depends on the machine's speed against the 0.5 s
            # window: the load counter says it was loaded, whenever it is read)
            assert c.post(CHAT, json=chat("tiny-a")).status_code == 200
            assert load_count(c, "tiny-a") == 1
            assert wait_until(lambda: loaded(c) == {}, timeout=60), "not unloaded after keep_alive"
            assert s.manager.entries == {}
            assert c.post(CHAT, json=chat("tiny-a")).status_code == 200  # reloads
            assert load_count(c, "tiny-a") == 2


def test_concurrent_first_requests_share_one_load(tiny_paths):
    with serve(ServerConfig(engine=EngineConfig(kv_cache_gb=0.01), models=(str(tiny_paths[0]),), keep_alive=None)) as s:
        statuses: list[int] = []

        async def one(c: httpx.AsyncClient) -> None:
            statuses.append((await c.post(CHAT, json=chat("tiny-a"))).status_code)

        async def main() -> None:
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                async with anyio.create_task_group() as tg:
                    for _ in range(6):
                        tg.start_soon(one, c)

        anyio.run(main)
        assert statuses == [200] * 6
        with httpx.Client(base_url=s.url) as c:
            assert load_count(c, "tiny-a") == 1
            ps = c.get("/api/ps").json()["models"]
            assert int(ps[0]["expires_at"][:4]) > 2200  # keep_alive None: never expires (as Ollama says it)


def test_max_loaded_models_evicts_least_recently_used(tiny_paths):
    a, b = map(str, tiny_paths)
    with serve(ServerConfig(engine=EngineConfig(kv_cache_gb=0.01),
                            models=(a, b), keep_alive=None, max_loaded_models=1)) as s:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.post(CHAT, json=chat("tiny-a")).status_code == 200
            assert loaded(c) == {"tiny-a": "loaded"}
            assert c.post(CHAT, json=chat("tiny-b")).status_code == 200
            assert loaded(c) == {"tiny-b": "loaded"}
            # a full path names the same model as its id
            assert c.post(CHAT, json=chat(a)).json()["model"] == "tiny-a"
            assert loaded(c) == {"tiny-a": "loaded"}
    with serve(ServerConfig(engine=EngineConfig(kv_cache_gb=0.01),
                            models=(a, b), keep_alive=None, max_loaded_models=2)) as s:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            for m in ("tiny-a", "tiny-b"):
                assert c.post(CHAT, json=chat(m)).status_code == 200
            assert loaded(c) == {"tiny-a": "loaded", "tiny-b": "loaded"}


def test_ollama_keep_alive_zero_unloads_and_negative_keeps(tiny_paths):
    with serve(ServerConfig(engine=EngineConfig(kv_cache_gb=0.01), models=(str(tiny_paths[0]),), keep_alive=300)) as s:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            r = c.post("/api/generate", json={"model": "tiny-a", "prompt": "hi", "stream": False,
                                              "options": {"num_predict": 2}, "keep_alive": -1})
            assert r.status_code == 200
            assert int(c.get("/api/ps").json()["models"][0]["expires_at"][:4]) > 2200
            r = c.post("/api/generate", json={"model": "tiny-a", "prompt": "hi", "stream": False,
                                              "options": {"num_predict": 2}, "keep_alive": 0})
            assert r.status_code == 200 and r.json()["eval_count"] >= 1
            assert wait_until(lambda: loaded(c) == {}, timeout=60)
            # Ollama's way to load without generating, and to unload without generating
            r = c.post("/api/generate", json={"model": "tiny-a"})
            assert r.json()["done_reason"] == "load" and loaded(c) == {"tiny-a": "loaded"}
            exp = c.get("/api/ps").json()["models"][0]["expires_at"]
            assert int(exp[:4]) < 2200  # the server default (5 minutes) again
            r = c.post("/api/chat", json={"model": "tiny-a", "messages": [], "keep_alive": 0})
            assert r.json()["done_reason"] == "unload" and loaded(c) == {}


def test_offload_tiers_show_in_metrics(tiny_paths, tmp_path):
    """With --kv-offload cpu,disk the tiers' counters are exported per model in /metrics."""
    engine = EngineConfig(kv_cache_gb=0.01, kv_offload="cpu,disk", cpu_kv_gb=0.01, disk_kv_gb=0.01,
                          disk_kv_path=str(tmp_path / "kv"))
    with serve(ServerConfig(engine=engine, models=(str(tiny_paths[0]),))) as s:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.post(CHAT, json=chat("tiny-a")).status_code == 200
            text = c.get("/metrics").text
    for name in ("edgeserve_kv_offload_host_blocks", "edgeserve_kv_offload_disk_hits",
                 "edgeserve_kv_offload_bytes_device_to_host", "edgeserve_kv_offload_swap_outs"):
        assert metric(text, name, 'model="tiny-a"') is not None, name
    assert metric(text, "edgeserve_kv_offload_disk_enabled", 'model="tiny-a"') == 1.0


def test_serve_passes_offload_flags_to_the_engine():
    from edgeserve.cli import build_parser, server_config_from_args

    args = build_parser().parse_args(["serve", "--kv-offload", "cpu", "--cpu-kv-gb", "2", "--no-prefix-cache"])
    engine = server_config_from_args(args).engine
    assert engine.kv_offload == "cpu" and engine.cpu_kv_gb == 2 and engine.enable_prefix_caching is False
