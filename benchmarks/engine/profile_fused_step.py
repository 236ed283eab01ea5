"""Where a fused CPU decode step's time goes, section by section (norms, activation quantize, each matmul, RoPE,
attention, SiLU-mul, Gemma 4's per-layer input, the output head), at each batch size.

Builds the native library once more with -DQMM_PROFILE (layer.c then adds up wall time per section), loads the
model on it, fills a paged pool for B sequences of `--context` tokens and times forward + logits of one decode row
per sequence `--reps` times. Prints the median per step of each section (ms and share of the step) as JSON.
`--rows 1,2,3`: that many rows per sequence instead (an MTP verification step's shape: the last token and its
drafts), with the drafts kept off a hybrid's recurrent states as the engine runs them (StepStates.keep).

    python benchmarks/engine/profile_fused_step.py [--model smollm2-135m | GGUF] [--batch 1,8] [--context 128] [--reps 30]
        [--rows 1] [--source-dir DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import tempfile
import time

SECTIONS = ["norm", "quantize", "qkv", "rope_kv", "attention", "o", "gate_up", "silu_mul", "down", "per_layer_input",
            "moe"]


def profiling_library(source_dir: str | None = None) -> ctypes.CDLL:
    """The best variant's library built with -DQMM_PROFILE (from `source_dir`'s C files where given, else this
    checkout's), installed as the process's native library."""
    from pathlib import Path

    from edgeserve.kernels.cpu import native as cpu_native

    variant = cpu_native.best_variant()
    flags = ["-O3", "-shared", "-fPIC", "-pthread", "-std=gnu11", "-DQMM_PROFILE", *cpu_native.VARIANT_FLAGS[variant]]
    path = os.path.join(tempfile.mkdtemp(), f"qmatmul-{variant}-profile.so")
    root = Path(source_dir) if source_dir else cpu_native.CPU_DIR
    sources = cpu_native.sources(root)
    subprocess.run([cpu_native.compiler(), *flags, f"-I{root / 'include'}", *map(str, sources), "-o", path, "-lm"], check=True)
    lib = cpu_native._bind(ctypes.CDLL(path))
    setting = (os.environ.get("EDGESERVE_NATIVE", "1"), os.environ.get("EDGESERVE_NATIVE_VARIANT", ""))
    cpu_native._chosen[setting] = lib
    return lib


def hybrid_states(config, b: int):
    """For a hybrid model: a function of the rows per sequence giving the step's recurrent states of `b` sequences
    (one slot each, the same slots every step); for others a function giving None."""
    if not config.is_hybrid:
        return lambda rows: None
    import torch

    from edgeserve.engine.cache.state_pool import StatePool, StepStates, state_spec_for

    pool = StatePool(state_spec_for(config), b)
    slots = torch.tensor([pool.allocate() for _ in range(b)])
    return lambda rows: StepStates.build(pool, torch.arange(b + 1) * rows, slots, [1] * b if rows > 1 else None)


def _parse_args() -> argparse.Namespace:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rows", default="1", help="rows per sequence per step (1 + drafts), comma-separated")
    ap.add_argument("--source-dir", help="C sources to build instead of this checkout's (another commit's kernels/cpu, "
                                         "with this checkout's layer.c for the marks)")
    return ap.parse_args()


def main() -> None:
    args = _parse_args()

    lib = profiling_library(args.source_dir)
    counters = (ctypes.c_int64 * len(SECTIONS)).in_dll(lib, "qmm_profile_ns")

    import torch

    from edgeserve import LLM
    from edgeserve.kernels.cpu import native as cpu_native
    from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention
    from edgeserve.kernels.torch.paged_attention import AttentionMetadata

    llm = LLM(args.model, kv_cache_gb=0.05)
    model = llm.lm.model
    assert model.native_decoder() is not None, "this model does not take the fused native stack here"
    head = model.lm_head
    print(json.dumps({"model": args.model, "head": [p.qtype for p in head.parts], "head_shape": list(head.shape),
                      "threads": cpu_native.threads()}))
    block = 16
    per_seq = -(-(args.context + 8) // block)
    for b, n in ((int(x), int(y)) for x in args.batch.split(",") for y in args.rows.split(",")):
        pool = KVPool(model.config, b * per_seq, block, model.dtype)
        states = hybrid_states(model.config, b)
        tables = [[i * per_seq + j for j in range(per_seq)] for i in range(b)]
        ids = torch.randint(100, 1000, (b * args.context,))
        pos = torch.arange(args.context).repeat(b)
        slots = [tables[i][p // block] * block + p % block for i in range(b) for p in range(args.context)]
        model.forward(ids, pos, PagedKVAttention(pool, AttentionMetadata.build([args.context] * b, [args.context] * b,
                                                                               tables, slots),
                                                 states=states(args.context)))
        p = args.context
        step_slots = [tables[i][q // block] * block + q % block for i in range(b) for q in range(p, p + n)]
        ids, pos = torch.randint(100, 1000, (b * n,)), torch.arange(p, p + n).repeat(b)
        rows: dict[str, list[float]] = {k: [] for k in [*SECTIONS, "stack_total", "forward", "head", "step"]}
        for r in range(args.reps + 2):
            for i in range(len(SECTIONS)):
                counters[i] = 0
            meta = AttentionMetadata.build([n] * b, [p + n] * b, tables, step_slots)
            t0 = time.perf_counter()
            hidden = model.forward(ids, pos, PagedKVAttention(pool, meta, states=states(n)))
            t1 = time.perf_counter()
            model.logits(hidden)
            t2 = time.perf_counter()
            if r < 2:  # warm-up
                continue
            for i, name in enumerate(SECTIONS):
                rows[name].append(counters[i] / 1e6)
            rows["stack_total"].append(sum(counters) / 1e6)
            rows["forward"].append((t1 - t0) * 1e3)
            rows["head"].append((t2 - t1) * 1e3)
            rows["step"].append((t2 - t0) * 1e3)
        med = {k: statistics.median(v) for k, v in rows.items()}
        step = med["step"]
        out = {k: {"ms": round(v, 3), "share": round(v / step, 3)} for k, v in med.items()}
        out["forward_outside_stack"] = {"ms": round(med["forward"] - med["stack_total"], 3)}
        print(json.dumps({"batch": b, "rows": n, "median_per_step": out}), flush=True)
    model._native = False


if __name__ == "__main__":
    main()
