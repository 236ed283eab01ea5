"""Time to first token for a request whose long prefix is (a) not cached, (b) in the main KV pool, (c) in the
host tier, (d) on disk only (page cache warm, and cold after POSIX_FADV_DONTNEED on the block files); then the
copy bandwidth of each tier on its own.

Each round uses a fresh random prefix and measures every case in turn, so machine drift hits all alike;
reports medians. Engine defaults otherwise (max_num_batched_tokens 512: a 2,000-token prefill runs in chunks).

    python benchmarks/engine/offload_ttft.py [--prefix 2000] [--rounds 5] [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", default=None)
    a = ap.parse_args()

    from edgeserve.engine.config import EngineConfig
    from edgeserve.engine.core import EngineCore
    from edgeserve.engine.cache.kv_cache import kv_bytes_per_token
    from edgeserve.models.load import load_model
    from edgeserve.registry import DEFAULT_MODEL, resolve
    from edgeserve.sampling_params import SamplingParams

    lm = load_model(resolve(a.model or DEFAULT_MODEL))
    bs = 16
    block_bytes = kv_bytes_per_token(lm.config, lm.model.dtype) * bs
    pool_blocks = a.prefix // bs + 16  # one long prompt at a time: the next one evicts the previous
    disk_dir = Path(tempfile.mkdtemp(prefix="edgeserve-kv-bench-"))

    alloc_time = [0.0]  # time spent in BlockManager.allocate: prefix lookup over the tiers and the copies up

    def engine() -> EngineCore:
        eng = EngineCore(lm, EngineConfig(block_size=bs, kv_cache_gb=pool_blocks * block_bytes / 2**30,
                                          kv_offload="cpu,disk", cpu_kv_gb=4, disk_kv_gb=8,
                                          disk_kv_path=str(disk_dir)))
        bm = eng.scheduler.block_manager
        allocate = bm.allocate

        def timed_allocate(*args, **kwargs):
            start = time.perf_counter()
            try:
                return allocate(*args, **kwargs)
            finally:
                alloc_time[0] += time.perf_counter() - start
        bm.allocate = timed_allocate
        return eng

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def ttft(eng: EngineCore, ids: list[int]) -> tuple[float, int]:
        alloc_time[0] = 0.0
        start = time.perf_counter()
        rid = eng.add_request(ids, params)
        while True:
            for out in eng.step():
                if out.request_id == rid and out.token_ids:
                    elapsed = time.perf_counter() - start
                    while eng.has_work():
                        eng.step()
                    return elapsed, out.num_cached_tokens

    g = torch.Generator().manual_seed(0)
    vocab = lm.config.vocab_size

    def rand(n: int) -> list[int]:
        return torch.randint(1000, min(vocab, 40000), (n,), generator=g).tolist()

    times: dict[str, list[float]] = {k: [] for k in ("a", "b", "c", "d_warm", "d_cold")}
    allocs: dict[str, list[float]] = {k: [] for k in times}
    cached: dict[str, int] = {}
    ttft(engine(), rand(64))  # warm-up
    for r in range(a.rounds):
        prefix = rand(a.prefix)
        eng = engine()
        for case in ("a", "b"):
            t, cached[case] = ttft(eng, prefix + rand(16))
            times[case].append(t)
            allocs[case].append(alloc_time[0])
        ttft(eng, rand(a.prefix))  # another long prompt pushes the prefix out of the pool into the host tier
        t, cached["c"] = ttft(eng, prefix + rand(16))
        times["c"].append(t)
        allocs["c"].append(alloc_time[0])
        eng.close()  # everything cached goes down to disk
        t, cached["d_warm"] = ttft(engine(), prefix + rand(16))  # new tiers: empty host, disk index from files
        times["d_warm"].append(t)
        allocs["d_warm"].append(alloc_time[0])
        for f in disk_dir.rglob("*.kvb"):  # drop the block files from the page cache
            fd = os.open(f, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        t, cached["d_cold"] = ttft(engine(), prefix + rand(16))
        times["d_cold"].append(t)
        allocs["d_cold"].append(alloc_time[0])
        print(f"round {r}: " + ", ".join(f"{k} {v[-1] * 1000:.0f} ms" for k, v in times.items()), flush=True)
    labels = {"a": "(a) not cached", "b": "(b) main pool", "c": "(c) host tier", "d_warm": "(d) disk, page cache warm",
              "d_cold": "(d) disk, page cache dropped"}
    base = statistics.median(times["a"])
    print(f"\nprefix {a.prefix} tokens + 16 new, {a.rounds} rounds, median TTFT:")
    print("| case | cached prompt tokens | TTFT | of which prefix lookup + copy up | vs not cached |")
    print("| --- | --- | --- | --- | --- |")
    for k, label in labels.items():
        m = statistics.median(times[k])
        print(f"| {label} | {cached[k]} | {m * 1000:.0f} ms | {statistics.median(allocs[k]) * 1000:.0f} ms "
              f"| {base / m:.1f}x faster |")
    bandwidth(lm, block_bytes, a.prefix // bs, disk_dir)


def bandwidth(lm, block_bytes: int, n_blocks: int, root: Path) -> None:
    """GB/s of each tier copy for `n_blocks` blocks of the model's layout, timed on the TierManager directly."""
    from edgeserve.offload import KVLayout, TierManager
    from edgeserve.engine.cache.kv_blocks import block_hash

    c = lm.config
    layout = KVLayout("bandwidth-bench", lm.model.dtype, c.num_layers, 16, c.num_kv_heads, c.head_dim)
    pool_k = torch.randn(c.num_layers, n_blocks, 16, c.num_kv_heads, c.head_dim).to(lm.model.dtype)
    pool_v = torch.randn_like(pool_k)
    hashes, parent = [], b""
    for i in range(n_blocks):
        parent = block_hash(parent, list(range(i * 16, i * 16 + 16)))
        hashes.append(parent)
    tm = TierManager(layout, host_bytes=4 << 30, disk_root=root / "bw", disk_bytes=8 << 30)
    total = n_blocks * block_bytes
    rows = []

    def timed(label: str, fn) -> None:
        start = time.perf_counter()
        fn()
        dt = time.perf_counter() - start
        rows.append((label, dt, total / dt / 1e9))

    timed("pool -> host (save)", lambda: [tm.save(h, b"", (), pool_k[:, i], pool_v[:, i]) for i, h in enumerate(hashes)])
    timed("host -> disk (write + CRC-32 + rename)", tm.flush)
    timed("host -> pool (load_into)", lambda: [tm.load_into(h, pool_k[:, i], pool_v[:, i]) for i, h in enumerate(hashes)])
    fresh = TierManager(layout, host_bytes=4 << 30, disk_root=root / "bw", disk_bytes=8 << 30)
    timed("disk -> pool, page cache warm (read + verify)",
          lambda: [fresh.load_into(h, pool_k[:, i], pool_v[:, i]) for i, h in enumerate(hashes)])
    for f in (root / "bw").rglob("*.kvb"):
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    timed("disk -> pool, page cache dropped",
          lambda: [fresh.load_into(h, pool_k[:, i], pool_v[:, i]) for i, h in enumerate(hashes)])
    print(f"\n{n_blocks} blocks of {block_bytes / 2**10:.0f} KiB ({total / 1e6:.1f} MB):")
    print("| copy | time | GB/s |")
    print("| --- | --- | --- |")
    for label, dt, gbs in rows:
        print(f"| {label} | {dt * 1000:.0f} ms | {gbs:.2f} |")


if __name__ == "__main__":
    main()
