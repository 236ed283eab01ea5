"""A cold prefill's time with this checkout's native CPU library against a baseline library (built from another
commit's kernels/cpu sources), interleaved in one process over the same loaded model.

    python benchmarks/engine/native_lib_prefill_ab.py MODEL.gguf --baseline-lib OLD.so [--tokens 1000] [--rounds 5]

Build OLD.so from a commit's sources with the flags of `kernels.cpu.native.build` for this CPU's variant, e.g.
`git archive BASE kernels/cpu | tar -x -C base` then `gcc -O3 -shared -fPIC -pthread -std=gnu11 <VARIANT_FLAGS>
-Ibase/kernels/cpu/include $(find base/kernels/cpu/src -name '*.c') -o OLD.so -lm` (a commit before the src/
layout: `base/kernels/cpu/*.c`, `-Ibase/kernels/cpu`). Both libraries must agree on
the repacked weight layouts (qmm_repack) and the entry points: the model's weights are loaded once, by this
checkout. `--base-malloc`: the baseline runs also get the glibc setting main had before `reuse_step_buffers`
(the load's 1 MiB mmap threshold left in place, every megabyte buffer a fresh mapping), the others this checkout's.
Each round times one fresh prompt (its first token changed: no prefix-cache hit) per library, in
alternating order; it prints the median wall and process-CPU milliseconds of each and their ratio.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

from edgeserve import LLM, SamplingParams
from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.memory import release_large_frees_to_os, reuse_step_buffers


def _use(lib: ctypes.CDLL, weights: list[cpu_native.BlockWeight]) -> None:
    """Route every native call of this process to `lib` (the kernels ask `library()` per call; weights keep theirs)."""
    for key in list(cpu_native._chosen):
        cpu_native._chosen[key] = lib
    for w in weights:
        w.lib = lib


def _block_weights(obj, seen: set[int] | None = None) -> list[cpu_native.BlockWeight]:
    """Every BlockWeight reachable from a model object through attributes, lists and dicts."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, cpu_native.BlockWeight):
        return [obj]
    children = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else \
        vars(obj).values() if hasattr(obj, "__dict__") and not isinstance(obj, type) else []
    out = []
    for child in children:
        if not isinstance(child, (int, float, str, bytes, type(None))) and not hasattr(child, "data_ptr"):
            out += _block_weights(child, seen)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--baseline-lib", required=True)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--base-malloc", action="store_true", help="the baseline runs with main's glibc setting too")
    args = ap.parse_args()
    llm = LLM(args.model, kv_cache_gb=0.3)
    mine = cpu_native.library()
    assert mine is not None, "the native library is not available here"
    base = cpu_native._bind(ctypes.CDLL(args.baseline_lib))
    weights = _block_weights(llm.lm)
    words = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. ")
    ids = [(words * (args.tokens // len(words) + 1))[:args.tokens]]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times: dict[str, list[tuple[float, float]]] = {"this": [], "base": []}
    print(f"{len(weights)} native weights; variant {cpu_native.best_variant()}, {cpu_native.threads()} threads")
    for r in range(args.rounds + 1):
        order = [("this", mine), ("base", base)] if r % 2 else [("base", base), ("this", mine)]
        for name, lib in order:
            _use(lib, weights)
            if args.base_malloc:
                (release_large_frees_to_os if name == "base" else reuse_step_buffers)()
            ids[0][0] += 1
            wall, cpu = time.perf_counter(), time.process_time()
            llm.generate(ids, params)
            if r:  # round 0 warms both up
                times[name].append(((time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3))
    _use(mine, weights)
    reuse_step_buffers()
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}
    for k, (w, c) in med.items():
        print(f"{k:5s} wall {w:9.1f} ms  cpu {c:9.1f} ms  rounds {[round(x) for x, _ in times[k]]} "
              f"cpu {[round(x) for _, x in times[k]]}")
    print(f"this / base: wall {med['this'][0] / med['base'][0]:.3f}x, cpu {med['this'][1] / med['base'][1]:.3f}x")


if __name__ == "__main__":
    main()
