"""kernels/cpu/src/lora.c alone, this tree against another revision's (default: the branch's start, HEAD of main as the
lead merges it), in one process, interleaved: the adapters' part of one decode step (every layer and fused weight of
the default model's shapes), 8 rows over 4 rank-16 all-projection adapters; the baseline reads bfloat16 as the
engine kept them, this tree bfloat16 and its int8 copy (--lora-weights int8). Also the int8 copy's error against
the float update.

    python benchmarks/kernels/lora_kernel_ab.py [--baseline REV] [--adapters 4] [--rows 8] [--reps 40]
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from edgeserve.kernels.cpu import lora as cpu_lora
from edgeserve.kernels.cpu.native import VARIANT_FLAGS, best_variant, compiler, library
from edgeserve.models.lora import LoraAdapter, LoraPair, LoraPart
from edgeserve.models.lora_step import StepLora

ROOT = Path(__file__).resolve().parents[2]
SHAPES = dict(hidden=576, ffn=1536, kv=192, layers=30)  # SmolLM2-135M


def baseline(rev: str, folder: Path):
    """(the library of `rev`'s lora.c + pool.c, its cpu_lora module)."""
    for name in ("kernels/cpu/src/lora.c", "kernels/cpu/src/pool.c", "kernels/cpu/include/pool.h", "kernels/cpu/lora.py"):
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{name}"], capture_output=True, check=True).stdout
        (folder / Path(name).name).write_bytes(text)
    lib = folder / "base.so"
    subprocess.run([compiler(), "-O3", "-shared", "-fPIC", "-pthread", "-std=gnu11", *VARIANT_FLAGS[best_variant()],
                    str(folder / "lora.c"), str(folder / "pool.c"), "-o", str(lib)], check=True, capture_output=True)
    spec = importlib.util.spec_from_file_location("base_cpu_lora", folder / "cpu_lora.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return bind(ctypes.CDLL(str(lib))), module


def bind(lib):
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    lib.qmm_lora_add.argtypes = [p, i32, i32, p, i32, i64, i32, i32, p, i64, i32]
    lib.qmm_set_threads(2)
    return lib


def adapters(n: int, rank: int, int8: bool) -> list[LoraAdapter]:
    """n random bfloat16 adapters of rank `rank` on every projection (the same seeds whatever `int8`)."""
    h, f, kv, layers = SHAPES["hidden"], SHAPES["ffn"], SHAPES["kv"], SHAPES["layers"]
    torch.manual_seed(0)

    def pair(k, outs):
        parts = [LoraPart(i * rank, sum(outs[:i]), torch.randn(rank, o) * 0.04) for i, o in enumerate(outs)]
        return LoraPair(torch.randn(rank * len(outs), k) * 0.04, parts)

    out = []
    for i in range(n):
        layer_pairs = [{"qkv": pair(h, [h, kv, kv]), "o_proj": pair(h, [h]), "gate_up": pair(h, [f, f]),
                        "down": pair(f, [h])} for _ in range(layers)]
        a = LoraAdapter(f"a{i}", Path("."), b"", rank, layer_pairs).to("cpu", torch.bfloat16)
        a.int8 = int8
        out.append(a)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", default="1cbf450", help="git revision to compare with (default: this branch's start)")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--reps", type=int, default=40)
    args = p.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="lora-ab-"))
    base_lib, base_mod = baseline(args.baseline, tmp)
    lib = library()
    t = args.rows
    steps = {}
    for label, module, kernel, int8 in [(f"{args.baseline} bf16", base_mod, base_lib, False),
                                        ("this bf16", cpu_lora, lib, False), ("this int8", cpu_lora, lib, True)]:
        ads = adapters(args.adapters, args.rank, int8)
        step = StepLora.build([(ads[i % len(ads)], 1.0) for i in range(t)], [1] * t)
        steps[label] = (kernel, step, module.step_struct(step))
    h, f, kv = SHAPES["hidden"], SHAPES["ffn"], SHAPES["kv"]
    shapes = [(h, h + 2 * kv), (h, h), (h, 2 * f), (f, h)]
    xs = [torch.randn(t, k) for k, _ in shapes]

    def run(kernel, struct) -> torch.Tensor:
        outs = [torch.zeros(t, n) for _, n in shapes]
        for layer in range(SHAPES["layers"]):
            for j, (k, n) in enumerate(shapes):
                kernel.qmm_lora_add(ctypes.addressof(struct), layer, j, xs[j].data_ptr(), 0, k, t, k,
                                    outs[j].data_ptr(), n, n)
        return torch.cat([o.flatten() for o in outs])

    ref = run(steps["this bf16"][0], steps["this bf16"][2][0])
    for label, (kernel, _, (struct, _)) in steps.items():
        err = float((run(kernel, struct) - ref).norm() / ref.norm())
        print(f"{label:16s} update's relative RMS difference from this tree's bf16: {err:.2e}")
    flush = torch.empty(64 << 20, dtype=torch.uint8)  # the weights come from memory, as in a real step
    times: dict[str, list[float]] = {label: [] for label in steps}
    for _ in range(args.reps):
        for label, (kernel, _, (struct, _)) in steps.items():
            flush.add_(1)
            start = time.perf_counter()
            run(kernel, struct)
            times[label].append((time.perf_counter() - start) * 1000)
    first = statistics.median(times[f"{args.baseline} bf16"])
    print(f"{t} rows over {args.adapters} rank-{args.rank} adapters, every projection, {SHAPES['layers']} layers: "
          f"wall ms per step's adapters (medians of {args.reps}, interleaved)")
    for label, v in times.items():
        print(f"  {label:16s} {statistics.median(v):6.2f} ms (min {min(v):.2f})  {first / statistics.median(v):.2f}x "
              f"the baseline's speed")


if __name__ == "__main__":
    sys.exit(main())
