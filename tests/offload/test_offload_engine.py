"""KV offload end to end on a tiny random GGUF: EngineCore with a deliberately tiny pool, host and disk tiers.

Every run is compared token for token with a run that has offload off; the counters prove which path was taken.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from edgeserve.engine.config import EngineConfig
from edgeserve.engine.core import EngineCore
from edgeserve.engine.cache.kv_cache import kv_bytes_per_token
from edgeserve.models.load import load_model
from edgeserve.registry import resolve
from edgeserve.sampling_params import SamplingParams

from support import engine_checks
from tiny_gguf import write_tiny_llama

BS = 8  # tokens per block
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("offload-model") / "tiny.gguf", hidden=64, heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def tiny_lm(tiny_path):
    return load_model(resolve(str(tiny_path)))


def block_bytes(lm) -> int:
    return kv_bytes_per_token(lm.config, lm.model.dtype) * BS


def config(lm, pool_blocks: int, host_blocks: int = 0, disk: Path | None = None, disk_blocks: float = 1000,
           **kw) -> EngineConfig:
    """An engine config with a pool of `pool_blocks` blocks and tiers sized in blocks."""
    gib = block_bytes(lm) / 2**30
    mode = "cpu,disk" if disk is not None else ("cpu" if host_blocks else "none")
    return EngineConfig(block_size=BS, kv_cache_gb=pool_blocks * gib, kv_offload=mode,
                        cpu_kv_gb=max(host_blocks, 1) * gib, disk_kv_gb=disk_blocks * gib * 1.02,
                        disk_kv_path=str(disk) if disk else None, **kw)


def drive(engine: EngineCore, prompts: list[list[int]], concurrent: bool = False):
    """engine_checks.drive with greedy sampling."""
    return engine_checks.drive(engine, prompts, GREEDY, concurrent)


def docs_workload(n_docs: int = 3, doc_blocks: int = 5, n_requests: int = 9, seed: int = 0) -> list[list[int]]:
    """Requests that revisit a few long shared prefixes, in an order that evicts them in between."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(3, 259, (doc_blocks * BS,), generator=g).tolist() for _ in range(n_docs)]
    return [docs[i % n_docs] + [10 + i, 20 + i, 30 + i] for i in range(n_requests)]


@pytest.fixture(scope="module")
def reference(tiny_lm):
    """Outputs with offload off and a pool that holds everything."""
    prompts = docs_workload()
    return prompts, drive(EngineCore(tiny_lm, config(tiny_lm, 200)), prompts)[0]


def test_tiny_pool_hits_host_and_disk_with_identical_outputs(tiny_lm, reference, tmp_path):
    prompts, ref = reference
    plain = EngineCore(tiny_lm, config(tiny_lm, 8))  # one document (6 blocks) at a time
    assert drive(plain, prompts)[0] == ref
    engine = EngineCore(tiny_lm, config(tiny_lm, 8, host_blocks=6, disk=tmp_path))
    outs, cached = drive(engine, prompts)
    assert outs == ref
    stats = engine.stats()
    assert stats.offload.host_hits > 0 and stats.offload.disk_hits > 0
    assert all(cached[f"r{i}"] == 5 * BS for i in range(3, 9))  # every revisit found its document
    assert stats.prompt_tokens_computed < plain.stats().prompt_tokens_computed
    assert stats.offload.bytes_host_to_disk > 0 and stats.offload.bytes_disk_to_device > 0


def test_host_only_offload_is_identical(tiny_lm, reference):
    prompts, ref = reference
    engine = EngineCore(tiny_lm, config(tiny_lm, 8, host_blocks=40))
    assert drive(engine, prompts)[0] == ref
    s = engine.stats().offload
    assert s.host_hits >= 6 * 5 and s.disk_hits == 0 and not s.disk_enabled


_WRITER = """
import sys
from edgeserve.engine.core import EngineCore
from edgeserve.models.load import load_model
from edgeserve.registry import resolve
from edgeserve.sampling_params import SamplingParams
sys.path.insert(0, {tests!r})
import test_offload_engine as t
lm = load_model(resolve({model!r}))
engine = EngineCore(lm, t.config(lm, 8, host_blocks=40, disk=__import__("pathlib").Path({disk!r})))
outs, _ = t.drive(engine, [{prompt!r}])
engine.close()
print(outs["r0"])
"""


def test_restart_answers_from_disk_in_a_new_process(tiny_lm, tiny_path, reference, tmp_path):
    prompts, ref = reference
    script = _WRITER.format(tests=str(Path(__file__).parent), model=str(tiny_path), disk=str(tmp_path),
                            prompt=prompts[0])
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                           (str(Path(__file__).parent), str(Path(__file__).parents[1])))})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(ref["r0"])
    engine = EngineCore(tiny_lm, config(tiny_lm, 8, host_blocks=40, disk=tmp_path))
    outs, cached = drive(engine, [prompts[3]])  # same document, another question
    assert outs["r0"] == ref["r3"]
    assert cached["r0"] == 5 * BS
    assert engine.stats().offload.disk_hits == 5 and engine.stats().prompt_tokens_computed == 3


def _chain_files(engine: EngineCore, prompt: list[int]) -> list[Path]:
    from edgeserve.engine.cache.kv_blocks import block_hash

    disk, parent, paths = engine.offload.tiers.disk, b"", []
    for i in range(len(prompt) // BS):
        parent = block_hash(parent, prompt[i * BS:(i + 1) * BS])
        paths.append(disk.path(parent))
    return paths


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_damaged_block_file_is_recomputed_with_identical_output(tiny_lm, reference, tmp_path, damage):
    prompts, ref = reference
    first = EngineCore(tiny_lm, config(tiny_lm, 8, host_blocks=40, disk=tmp_path))
    drive(first, [prompts[0]])
    first.close()
    files = _chain_files(first, prompts[0])
    assert all(p.exists() for p in files[:5])
    victim = files[2]
    if damage == "flip":
        data = bytearray(victim.read_bytes())
        data[-100] ^= 0x10
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        os.truncate(victim, victim.stat().st_size // 2)
    else:  # a block of another model with the same tokens, under this model's name
        other_lm = dataclasses.replace(tiny_lm, source=dataclasses.replace(tiny_lm.source, path=Path(__file__)))
        other = EngineCore(other_lm, config(tiny_lm, 8, host_blocks=40, disk=tmp_path))
        drive(other, [prompts[0]])
        other.close()
        foreign = _chain_files(other, prompts[0])[2]
        assert foreign != victim and foreign.exists()
        victim.write_bytes(foreign.read_bytes())
    second = EngineCore(tiny_lm, config(tiny_lm, 8, host_blocks=40, disk=tmp_path))
    outs, cached = drive(second, [prompts[3]])
    assert outs["r0"] == ref["r3"]
    s = second.stats()
    assert cached["r0"] == 2 * BS and s.offload.disk_hits == 2 and s.offload.corrupt_blocks == 1
    assert not victim.exists()


def test_swap_preemption_matches_unconstrained_run(tiny_lm):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 259, (int(n),), generator=g).tolist() for n in (13, 21, 9, 17, 25, 11)]
    ref = drive(EngineCore(tiny_lm, config(tiny_lm, 200)), prompts, concurrent=True)[0]
    # 7 blocks for 6 requests that need 2-4 blocks each: preemptions are forced (with every step's prompt tokens
    # at the full budget: the decode-slowdown limit would make the schedule, and so the preemptions, timing-bound)
    plain = EngineCore(tiny_lm, config(tiny_lm, 7, max_num_batched_tokens=32, max_decode_slowdown=None))
    assert drive(plain, prompts, concurrent=True)[0] == ref and plain.stats().num_preemptions > 0
    engine = EngineCore(tiny_lm, config(tiny_lm, 7, host_blocks=40, max_num_batched_tokens=32,
                                        max_decode_slowdown=None))
    assert drive(engine, prompts, concurrent=True)[0] == ref
    s = engine.stats()
    assert s.num_preemptions > 0 and s.offload.swap_outs > 0 and s.offload.swap_ins == s.offload.swap_outs
    # swapped-out requests come back with their KV: every prompt token is computed once, where recompute-on-
    # preemption computes some twice
    assert s.prompt_tokens_computed == sum(map(len, prompts)) < plain.stats().prompt_tokens_computed
    assert engine.offload.tiers.host.num_swapped == 0


def test_disk_budget_is_never_exceeded(tiny_lm, reference, tmp_path):
    prompts, ref = reference
    engine = EngineCore(tiny_lm, config(tiny_lm, 8, host_blocks=2, disk=tmp_path, disk_blocks=4))
    budget = engine.config.offload_config().disk_kv_bytes
    outs = {}
    for i, p in enumerate(prompts):
        outs[f"r{i}"] = drive(engine, [p])[0]["r0"]
        on_disk = sum(f.stat().st_size for f in tmp_path.rglob("*.kvb"))
        assert on_disk <= budget
    assert outs == ref
    s = engine.stats().offload
    assert 0 < s.disk_blocks <= 4 and s.bytes_host_to_disk > budget  # it filled up and evicted


def test_unwritable_disk_path_warns_once_and_serves(tiny_lm, reference, tmp_path, caplog):
    prompts, ref = reference
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="edgeserve.offload"):
        engine = EngineCore(tiny_lm, config(tiny_lm, 8, host_blocks=6, disk=blocker / "kv"))
        assert drive(engine, prompts)[0] == ref
    assert len([r for r in caplog.records if "turned off" in r.getMessage()]) == 1
    s = engine.stats().offload
    assert not s.disk_enabled and s.host_hits > 0 and s.disk_hits == 0


def test_cli_offload_flags_reach_the_engine_config():
    from edgeserve.cli import build_parser, engine_config_from_args
    from edgeserve.errors import EdgeserveError

    args = build_parser().parse_args(["run", "--kv-offload", "cpu,disk", "--cpu-kv-gb", "2", "--disk-kv-gb", "3",
                                      "--disk-kv-path", "/tmp/x"])
    cfg = engine_config_from_args(args)
    oc = cfg.offload_config()
    assert (oc.use_cpu, oc.use_disk, oc.cpu_kv_bytes, oc.disk_kv_bytes, str(oc.disk_path)) == \
        (True, True, 2 << 30, 3 << 30, "/tmp/x")
    assert engine_config_from_args(build_parser().parse_args(["run"])).kv_offload == "none"
    with pytest.raises(EdgeserveError, match="--kv-offload"):
        engine_config_from_args(build_parser().parse_args(["run", "--kv-offload", "gpu"]))


def test_async_engine_shutdown_persists_prefixes_to_disk(tiny_lm, reference, tmp_path):
    import anyio

    from edgeserve.engine.async_engine import AsyncEngine

    prompts, ref = reference
    engine = AsyncEngine(tiny_lm, config(tiny_lm, 200, host_blocks=40, disk=tmp_path))
    got: list[int] = []

    async def main():
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            async for delta in engine.generate(prompts[0], GREEDY):
                got.extend(delta.token_ids)
            engine.shutdown()
    anyio.run(main)
    assert got == ref["r0"]
    # The big pool never evicted anything: only shutdown put the document on disk.
    fresh = EngineCore(tiny_lm, config(tiny_lm, 8, host_blocks=40, disk=tmp_path))
    outs, cached = drive(fresh, [prompts[3]])
    assert outs["r0"] == ref["r3"] and cached["r0"] == 5 * BS and fresh.stats().offload.disk_hits == 5


@pytest.mark.slow
def test_default_model_tiny_pool_serves_prefixes_from_the_tiers_identically(default_model_fp32, tmp_path):
    lm = default_model_fp32
    g = torch.Generator().manual_seed(7)
    docs = [torch.randint(1000, 40000, (2 * BS,), generator=g).tolist() for _ in range(3)]
    prompts = [docs[i % 3] + [100 + i, 200 + i] for i in range(5)]  # documents 0 and 1 come back
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    def run(engine):
        outs, cached = {}, {}
        for i, p in enumerate(prompts):
            rid = engine.add_request(p, params)
            while engine.has_work():
                for o in engine.step():
                    outs.setdefault(i, []).extend(o.token_ids)
                    cached[i] = o.num_cached_tokens
        return outs, cached
    ref = run(EngineCore(lm, config(lm, 64)))[0]
    engine = EngineCore(lm, config(lm, 4, host_blocks=2, disk=tmp_path))  # one document at a time
    outs, cached = run(engine)
    assert outs == ref
    s = engine.stats().offload
    assert cached[3] == cached[4] == 2 * BS and s.host_hits + s.disk_hits == 4 and s.disk_hits > 0
