"""The q8_0 KV cache end to end on a tiny random GGUF (head size 32): the same --kv-cache-gb holds about twice the
tokens, greedy outputs do not depend on the batch, the chunking or the prefix cache, swap preemption and the host
and disk tiers keep q8_0 blocks, a disk block of another KV format is never read, and bad choices are refused
with one-line errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from support import engine_checks
from tiny_gguf import write_tiny_llama

from edgeserve.engine.config import EngineConfig
from edgeserve.engine.core import EngineCore
from edgeserve.engine.cache.kv_cache import kv_bytes_per_token
from edgeserve.engine.cache.kv_format import Q8_0, resolve_kv_format
from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.models.load import load_model
from edgeserve.offload import KVLayout
from edgeserve.offload.block_file import CorruptBlockError, decode
from edgeserve.offload.disk_tier import DiskTier
from edgeserve.registry import resolve
from edgeserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no native CPU kernels here")
BS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("kvq-model") / "tiny.gguf", hidden=128, heads=4, kv_heads=2,
                            ffn=256, qtype="Q8_0", seed=4)


@pytest.fixture(scope="module")
def tiny_lm(tiny_path):
    return load_model(resolve(str(tiny_path)))


def config(lm, pool_blocks: int, kv: str = "q8_0", host_blocks: int = 0, disk: Path | None = None,
           **kw) -> EngineConfig:
    """A config whose pool holds `pool_blocks` blocks of KV format `kv` (and tiers sized in such blocks)."""
    fmt = resolve_kv_format(kv, lm.config, lm.model.dtype, lm.model.device)
    gib = kv_bytes_per_token(lm.config, fmt) * BS / 2**30
    mode = "cpu,disk" if disk is not None else ("cpu" if host_blocks else "none")
    return EngineConfig(block_size=BS, kv_cache_gb=pool_blocks * gib * 1.001, kv_cache_dtype=kv, kv_offload=mode,
                        cpu_kv_gb=max(host_blocks, 1) * gib, disk_kv_gb=1000 * gib,
                        disk_kv_path=str(disk) if disk else None, **kw)


def drive(engine: EngineCore, prompts: list[list[int]], concurrent: bool = False):
    """engine_checks.drive with greedy sampling."""
    return engine_checks.drive(engine, prompts, GREEDY, concurrent)


def prompts(lengths, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 259, (int(n),), generator=g).tolist() for n in lengths]


def test_the_same_budget_holds_about_twice_the_tokens(tiny_lm):
    budget = EngineConfig(block_size=BS, kv_cache_gb=0.0005)
    f16 = EngineCore(tiny_lm, budget)  # the default beside bf16 compute on the CPU
    q8 = EngineCore(tiny_lm, EngineConfig(block_size=BS, kv_cache_gb=0.0005, kv_cache_dtype="q8_0"))
    assert f16.pool.k.dtype == torch.float16 and q8.pool.k.dtype == torch.uint8
    ratio = q8.pool.num_blocks / f16.pool.num_blocks
    assert 64 / 34 - 0.05 < ratio < 64 / 34 + 0.05  # 2 bytes per value against 34 bytes per 32 values
    assert q8.pool.nbytes <= 0.0005 * 2**30
    s = q8.stats()
    assert (s.kv_cache_dtype, s.kv_cache_bytes) == ("q8_0", q8.pool.nbytes)
    assert f16.stats().kv_cache_dtype == "f16"


def test_greedy_outputs_do_not_depend_on_batch_or_chunking(tiny_lm):
    ps = prompts((13, 37, 9, 21))
    alone = drive(EngineCore(tiny_lm, config(tiny_lm, 200, enable_prefix_caching=False)), ps)[0]
    together = drive(EngineCore(tiny_lm, config(tiny_lm, 200, enable_prefix_caching=False)), ps, concurrent=True)[0]
    chunked = drive(EngineCore(tiny_lm, config(tiny_lm, 200, enable_prefix_caching=False, max_num_batched_tokens=8,
                                                max_decode_slowdown=None)), ps, concurrent=True)[0]
    assert alone == together == chunked
    bf16 = drive(EngineCore(tiny_lm, config(tiny_lm, 200, kv="auto", enable_prefix_caching=False)), ps)[0]
    assert bf16 != alone  # the q8_0 pool is what the engine read (random weights are that sensitive)


def test_prefix_cache_reuse_gives_the_same_tokens(tiny_lm):
    base = prompts((40,), seed=7)[0]
    ps = [base + [5, 6, 7], base + [9, 10]]
    fresh = drive(EngineCore(tiny_lm, config(tiny_lm, 200, enable_prefix_caching=False)), ps)[0]
    outs, cached = drive(EngineCore(tiny_lm, config(tiny_lm, 200)), ps)
    assert outs == fresh
    assert cached["r1"] == 40 // BS * BS


def test_swap_preemption_keeps_q8_0_blocks(tiny_lm):
    ps = prompts((13, 21, 9, 17, 25, 11))
    ref = drive(EngineCore(tiny_lm, config(tiny_lm, 200)), ps, concurrent=True)[0]
    engine = EngineCore(tiny_lm, config(tiny_lm, 7, host_blocks=40, max_num_batched_tokens=32,
                                        max_decode_slowdown=None))
    assert drive(engine, ps, concurrent=True)[0] == ref
    s = engine.stats()
    assert s.num_preemptions > 0 and s.offload.swap_outs > 0 and s.offload.swap_ins == s.offload.swap_outs
    assert s.prompt_tokens_computed == sum(map(len, ps))


def test_host_and_disk_tiers_serve_q8_0_prefixes(tiny_lm, tmp_path):
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 259, (5 * BS,), generator=g).tolist() for _ in range(3)]
    ps = [docs[i % 3] + [10 + i, 20 + i] for i in range(9)]
    ref = drive(EngineCore(tiny_lm, config(tiny_lm, 200)), ps)[0]
    engine = EngineCore(tiny_lm, config(tiny_lm, 8, host_blocks=6, disk=tmp_path))
    assert engine.offload.tiers.layout.kv_format == "q8_0"
    outs, cached = drive(engine, ps)
    assert outs == ref
    s = engine.stats().offload
    assert s.disk_hits > 0 and s.bytes_disk_to_device > 0 and s.corrupt_blocks == 0
    assert all(cached[f"r{i}"] == 5 * BS for i in range(3, 9))


def test_disk_tier_round_trips_q8_0_blocks_and_refuses_other_formats(tmp_path):
    q8 = KVLayout("m", torch.uint8, num_layers=2, block_size=4, num_kv_heads=2, head_dim=68, kv_format="q8_0")
    bf16 = KVLayout("m", torch.bfloat16, num_layers=2, block_size=4, num_kv_heads=2, head_dim=64)
    same_bytes = KVLayout("m", torch.uint8, num_layers=2, block_size=4, num_kv_heads=2, head_dim=68)
    assert len({q8.key, bf16.key, same_bytes.key}) == 3
    g = torch.Generator().manual_seed(1)
    k = torch.randint(0, 256, q8.shape, generator=g, dtype=torch.uint8)
    v = torch.randint(0, 256, q8.shape, generator=g, dtype=torch.uint8)
    tier = DiskTier(tmp_path, q8, 10 * q8.block_nbytes)
    assert tier.put(b"\x01" * 32, b"", (1, 2, 3, 4), k, v)
    block = DiskTier(tmp_path, q8, 10 * q8.block_nbytes).get(b"\x01" * 32)  # a restart finds it
    assert torch.equal(block.k, k) and torch.equal(block.v, v)
    assert b"\x01" * 32 not in DiskTier(tmp_path, bf16, 10 * bf16.block_nbytes)  # another folder, another key
    data = bytearray(tier.path(b"\x01" * 32).read_bytes())
    for other in (bf16, same_bytes):
        with pytest.raises(CorruptBlockError):
            decode(bytearray(data), other, b"\x01" * 32)


def test_bad_choices_are_refused_with_one_line_errors(tiny_lm, tmp_path):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")
    c = tiny_lm.config
    assert resolve_kv_format("q8_0", c, torch.bfloat16, "cpu") == Q8_0
    # float16 K/V beside bf16 compute on the CPU (the default there, and by name); the compute dtype on a GPU
    assert resolve_kv_format("auto", c, torch.bfloat16, "cpu").storage == torch.float16
    assert resolve_kv_format("f16", c, torch.bfloat16, "cpu").storage == torch.float16
    assert resolve_kv_format("bf16", c, torch.bfloat16, "cpu").storage == torch.bfloat16
    assert resolve_kv_format("auto", c, torch.bfloat16, "cuda").storage == torch.bfloat16
    assert resolve_kv_format("auto", c, torch.float32, "cpu").storage == torch.float32
    for name, device, compute, message in (("fp8", "cpu", torch.bfloat16, "fp8 needs the Triton kernels"),
                                           ("f16", "cuda", torch.bfloat16, "compute dtype"),
                                           ("bf16", "cpu", torch.float32, "compute dtype"),
                                           ("q8_0", "cuda", torch.bfloat16, "CPU only")):
        with pytest.raises(ValueError, match=message):
            resolve_kv_format(name, c, compute, device)
    with pytest.raises(ValueError, match="soft-capping"):
        resolve_kv_format("q8_0", dataclasses.replace(c, attn_softcap=50.0), torch.bfloat16, "cpu")
    odd = load_model(resolve(str(write_tiny_llama(tmp_path / "odd.gguf", hidden=48, heads=2, kv_heads=1, ffn=64))))
    with pytest.raises(ValueError, match="multiples of 32"):
        EngineCore(odd, EngineConfig(kv_cache_gb=0.001, kv_cache_dtype="q8_0"))
