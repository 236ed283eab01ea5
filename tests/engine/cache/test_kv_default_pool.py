"""Issue 52 item 11: the default KV pool on a CPU holds a few requests at the model's full context (not a tenth of
the machine), capped at a fraction of free memory; an explicit --kv-cache-gb is taken as given; and `serve` says in
its first lines what each text model's pool will take and why."""

from __future__ import annotations

import pytest
from tiny_gguf import write_tiny_llama

from edgeserve.engine.cache import kv_cache
from edgeserve.engine.config import EngineConfig
from edgeserve.engine.core import EngineCore
from edgeserve.engine.cache.kv_budget import DEFAULT_KV_SEATS, default_cpu_budget
from edgeserve.engine.cache.kv_cache import kv_bytes_per_token
from edgeserve.models.load import load_model
from edgeserve.registry import resolve
from edgeserve.server import ServerConfig
from edgeserve.server.kv_plan import planned_kv_line

CONTEXT = 256


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("kvpool") / "tiny.gguf", context=CONTEXT)
    return path, load_model(resolve(str(path)))


def per_token(lm, core: EngineCore) -> int:
    return kv_bytes_per_token(lm.config, core.pool.kv_format)


def test_the_default_pool_holds_a_few_full_contexts(tiny):
    _, lm = tiny
    core = EngineCore(lm, EngineConfig())
    try:
        assert core.max_model_len == CONTEXT
        assert core.pool.nbytes == DEFAULT_KV_SEATS * CONTEXT * per_token(lm, core)  # not 32 seats' worth
        assert f"room for {DEFAULT_KV_SEATS} requests at the full {CONTEXT:,}-token context" in core.kv_budget.why
    finally:
        core.close()


def test_the_default_pool_leaves_room_on_a_small_machine(tiny, monkeypatch):
    _, lm = tiny
    core = EngineCore(lm, EngineConfig())
    want = core.pool.nbytes
    core.close()
    # a tenth of the free memory holds half of one context: the pool takes that, and the context shrinks to it
    monkeypatch.setattr(kv_cache, "free_memory_bytes", lambda device: 10 * want // (2 * DEFAULT_KV_SEATS))
    core = EngineCore(lm, EngineConfig())
    try:
        assert core.pool.nbytes == want // (2 * DEFAULT_KV_SEATS) and core.max_model_len == CONTEXT // 2
        assert core.kv_budget.why.startswith("a tenth of the")
    finally:
        core.close()


def test_an_explicit_size_is_taken_as_given(tiny):
    _, lm = tiny
    core = EngineCore(lm, EngineConfig(kv_cache_gb=0.001))
    try:
        blocks = int(0.001 * 2**30 // (per_token(lm, core) * 16))
        assert core.pool.num_blocks == min(blocks, 32 * CONTEXT // 16)
        assert core.kv_budget.why == "--kv-cache-gb"
    finally:
        core.close()


def test_default_budget_rule():
    full = default_cpu_budget(1000, 8192, 32, 100 * 2**30, 0.1)
    assert full.nbytes == 4 * 8192 * 1000 and "room for 4 requests" in full.why
    capped = default_cpu_budget(1000, 131072, 32, 2 * 2**30, 0.1)
    assert capped.nbytes == int(0.1 * 2 * 2**30) and "a tenth" in capped.why and "--kv-cache-gb" in capped.why
    assert default_cpu_budget(1000, 8192, 1, 100 * 2**30, 0.1).nbytes == 8192 * 1000  # --max-seqs 1: one seat


def test_serve_says_what_the_pool_takes_and_why(tiny):
    path, _ = tiny
    line = planned_kv_line(str(path), ServerConfig(models=(str(path),)))
    assert line.startswith("KV cache for tiny: ") and f"full {CONTEXT:,}-token context" in line
    assert "--kv-cache-gb sets it" in line
    line = planned_kv_line(str(path), ServerConfig(models=(str(path),), engine=EngineConfig(kv_cache_gb=2)))
    assert line == "KV cache for tiny: 2 GiB (--kv-cache-gb)"
    embed = write_tiny_llama(path.parent / "tinyemb.gguf", pooling_type=1)
    assert planned_kv_line(str(embed), ServerConfig(models=(str(embed),))) is None  # no KV pool
