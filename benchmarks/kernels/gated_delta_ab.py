"""Gated DeltaNet's native conv + SiLU and rule, this checkout's library against another build's (`--baseline-lib`),
side by side in one process, with the states cold as in a model's step: each call takes the next of `--layers`
state sets (18 at Qwen3.5-0.8B / 2B: 8 sequences' recurrent states are 8 MiB a layer, 144 MiB in all), the sides
taking turns round by round (A B, B A, ...). Prints the median ms per layer call of each side and the ratio, and the
largest difference between the sides' outputs.

    python benchmarks/kernels/gated_delta_ab.py --baseline-lib OLD.so [--lib NEW.so] [--threads 1] [--rounds 9]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.torch import gated_delta as gd

from gated_delta import case


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-lib", required=True)
    ap.add_argument("--lib", help="the 'this checkout' side (default: this checkout's build)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    libs = {"baseline": cpu_native._bind(ctypes.CDLL(args.baseline_lib)),
            "this checkout": cpu_native._bind(ctypes.CDLL(args.lib)) if args.lib else cpu_native.library()}
    for lib in libs.values():
        lib.qmm_set_threads(args.threads)
    dims = gd.DeltaNetDims(16, 16, 128, 128, 4)  # Qwen3.5-0.8B / 2B linear layers
    print(f"variant {libs['this checkout'].qmm_variant().decode()}, threads {args.threads}, dims {dims}")
    for name, lens in (("decode x1", [1]), (f"decode x{args.batch}", [1] * args.batch),
                       (f"prefill {args.prompt}", [args.prompt])):
        x, w, conv_state, batch, (q, k, v, g, beta, state, rb) = case(lens, dims)
        states = [state.clone() for _ in range(args.layers)]
        calls = {"conv": lambda lib, i: cpu_native.gdn_conv(x, w, conv_state, batch, lib=lib),
                 "rule": lambda lib, i: cpu_native.gdn_rule(q, k, v, g, beta, states[i], rb, lib=lib)}
        for label, call in calls.items():
            times: dict[str, list[float]] = {side: [] for side in libs}
            for r in range(args.rounds):
                for side in (list(libs) if r % 2 == 0 else list(libs)[::-1]):
                    t = time.perf_counter()
                    for i in range(args.layers):
                        call(libs[side], i)
                    times[side].append((time.perf_counter() - t) * 1e3 / args.layers)
            a, b = (statistics.median(times[s]) for s in libs)
            print(f"{name:<12} {label:<5} baseline {a:8.3f} ms  this checkout {b:8.3f} ms  {a / b:5.2f}x")
    x, w, conv_state, batch, (q, k, v, g, beta, state, rb) = case([5, 64, 1, 33], dims)
    outs = {s: (cpu_native.gdn_rule(q, k, v, g, beta, state.clone(), rb, lib=lib),
                cpu_native.gdn_conv(x, w, conv_state.clone(), batch, lib=lib)) for s, lib in libs.items()}
    (r0, c0), (r1, c1) = outs.values()
    print(f"largest difference: rule {(r0 - r1).abs().max().item():.3g} (outputs up to {r0.abs().max().item():.3g}), "
          f"conv {(c0 - c1).abs().max().item():.3g}")


if __name__ == "__main__":
    main()
