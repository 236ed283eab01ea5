"""Gated DeltaNet on the CPU: the native kernels (kernels/cpu/src/gated_delta.c) against the torch twins
(kernels.torch.gated_delta), per layer call, at Qwen3.5 shapes (default: 16 key heads, 32 value heads, 128 x 128 state,
conv kernel 4).

    python benchmarks/kernels/torch/gated_delta.py [--threads 2] [--reps 15] [--prompt 512] [--batch 8]

Prints the median wall time in ms of: decode (one token for each of 1 and --batch sequences), and a --prompt-token
prefill of one sequence (native token by token, the twin chunked by 64 and token by token), for the conv + SiLU and
for the rule. Both sides run at --threads threads.
"""

from __future__ import annotations

import argparse

import torch

from edgeserve.bench.timing import median_ms
from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.torch import gated_delta as gd


def case(lens: list[int], dims: gd.DeltaNetDims):
    gen = torch.Generator().manual_seed(0)
    t = sum(lens)
    x = torch.randn(t, dims.conv_dim, generator=gen)
    w = torch.randn(dims.conv_dim, dims.conv_kernel, generator=gen) * 0.3
    g = -torch.rand(t, dims.num_v_heads, generator=gen)
    beta = torch.rand(t, dims.num_v_heads, generator=gen)
    batch = gd.DeltaBatch.build(torch.tensor([0] + lens).cumsum(0), torch.arange(len(lens)))
    conv_state = torch.zeros(len(lens), dims.conv_kernel - 1, dims.conv_dim)
    state = torch.zeros(len(lens), dims.num_v_heads, dims.head_k_dim, dims.head_v_dim)
    q, k, v = x.split([dims.key_dim, dims.key_dim, dims.value_dim], dim=-1)
    q = q.reshape(t, dims.num_k_heads, dims.head_k_dim)
    k = k.reshape(t, dims.num_k_heads, dims.head_k_dim)
    v = v.reshape(t, dims.num_v_heads, dims.head_v_dim)
    return x, w, conv_state, batch, (q, k, v, g, beta, state, batch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--k-heads", type=int, default=16)
    ap.add_argument("--v-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lib = cpu_native.library()
    if lib is None:
        raise SystemExit("native CPU kernels unavailable")
    lib.qmm_set_threads(args.threads)
    dims = gd.DeltaNetDims(args.k_heads, args.v_heads, args.head_dim, args.head_dim, 4)
    print(f"variant {lib.qmm_variant().decode()}, threads {args.threads}, dims {dims}")
    print(f"{'case':<26} {'native ms':>10} {'twin ms':>10} {'twin/native':>12}")
    for name, lens in (("decode x1", [1]), (f"decode x{args.batch}", [1] * args.batch),
                       (f"prefill {args.prompt}", [args.prompt])):
        x, w, conv_state, batch, rule_args = case(lens, dims)
        rows = [("conv+silu", lambda: cpu_native.gdn_conv(x, w, conv_state, batch, lib=lib),
                 lambda: gd.causal_conv1d_silu(x, w, conv_state, batch)),
                ("rule", lambda: cpu_native.gdn_rule(*rule_args, lib=lib),
                 lambda: gd.gated_delta_rule(*rule_args))]
        if len(lens) == 1 and lens[0] > 1:
            rows.append(("rule (twin recurrent)", lambda: cpu_native.gdn_rule(*rule_args, lib=lib),
                         lambda: gd.recurrent_gated_delta_rule(*rule_args)))
        for label, native, twin in rows:
            n, t = median_ms(native, args.reps), median_ms(twin, args.reps)
            print(f"{name + ' ' + label:<26} {n:>10.3f} {t:>10.3f} {t / n:>11.2f}x")


if __name__ == "__main__":
    main()
