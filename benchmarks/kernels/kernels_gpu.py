"""Achieved memory bandwidth of the Triton decode kernels on a CUDA GPU: paged decode attention, W4A16 and W8A16
GEMV.

Decode is memory-bound, so each kernel is reported as GB/s (bytes it must read / median time) next to the
device's nominal bandwidth and a measured copy bandwidth. Shapes are Llama-3-8B's (32 query heads, 8 KV heads,
head_dim 128; hidden 4096, MLP 14336). bf16 on sm_80+, fp16 on sm_75.

    python benchmarks/kernels/kernels_gpu.py [--reps 50] [--context 4096] [--batches 1,8,32]
"""

from __future__ import annotations

import argparse
import sys

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--context", type=int, default=4096, help="KV tokens per sequence for decode attention")
    ap.add_argument("--batches", default="1,8,32", help="decode batch sizes for attention")
    ap.add_argument("--block-size", type=int, default=16)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernels_gpu.py needs a CUDA GPU and none is visible: nothing measured")

    from edgeserve.kernels import dispatch
    from edgeserve.kernels.triton.bench import copy_bandwidth_gbs, median_ms, peak_bandwidth_gbs
    from edgeserve.kernels.formats.quant_linear import Q4Blocks, Q8Blocks

    dev = torch.device("cuda")
    if not dispatch.HAS_TRITON:
        sys.exit("kernels_gpu.py needs Triton (pip install triton): nothing measured")
    dtype = dispatch.compute_dtype(dev)
    peak = peak_bandwidth_gbs(dev)
    copy = copy_bandwidth_gbs(dev)
    props = torch.cuda.get_device_properties(dev)
    print(f"device: {props.name}, sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB, dtype {dtype}, "
          f"torch {torch.__version__}, triton {__import__('triton').__version__}")
    print(f"nominal bandwidth: {peak:.0f} GB/s" if peak else "nominal bandwidth: unknown (torch has no memory clock)")
    print(f"measured copy bandwidth: {copy:.0f} GB/s (read + write)")
    ref = peak or copy

    def report(name: str, nbytes: int, ms: float) -> None:
        gbs = nbytes / (ms * 1e-3) / 1e9
        print(f"{name:<44} {ms * 1e3:9.1f} us  {gbs:8.0f} GB/s  {100 * gbs / ref:5.1f}% of {'nominal' if peak else 'copy'}")

    print("\n# paged decode attention (median), bytes = K + V read")
    heads, kv_heads, head_dim, bs = 32, 8, 128, a.block_size
    with dispatch.force_backend("triton"):
        for batch in [int(b) for b in a.batches.split(",")]:
            blocks_per_seq = -(-a.context // bs)
            num_blocks = batch * blocks_per_seq
            k_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, device=dev, dtype=dtype)
            v_cache = torch.randn_like(k_cache)
            perm = torch.randperm(num_blocks).tolist()
            tables = [perm[i * blocks_per_seq:(i + 1) * blocks_per_seq] for i in range(batch)]
            slots = [t[-1] * bs + (a.context - 1) % bs for t in tables]
            meta = dispatch.AttentionMetadata.build([1] * batch, [a.context] * batch, tables, slots, device=dev)
            q = torch.randn(batch, heads, head_dim, device=dev, dtype=dtype)
            ms = median_ms(lambda: dispatch.paged_attention(q, k_cache, v_cache, meta), reps=a.reps)
            nbytes = 2 * batch * a.context * kv_heads * head_dim * k_cache.element_size()
            report(f"batch {batch}, context {a.context}", nbytes, ms)
            del k_cache, v_cache

    print("\n# W4A16 / W8A16 GEMV, M = 1 (median), bytes = weight codes + scales (+ offsets) + x + y; "
          "int4 group 128, int8 group 32 (GGUF Q8_0)")
    shapes = {"qkv 4096->6144": (6144, 4096), "o 4096->4096": (4096, 4096), "gate_up 4096->28672": (28672, 4096),
              "down 14336->4096": (4096, 14336)}
    with dispatch.force_backend("triton"):
        for name, (n, k) in shapes.items():
            g = 128
            blocks = Q4Blocks(torch.randint(0, 16, (n, k), dtype=torch.uint8), torch.rand(n, k // g) * 0.01,
                              torch.randn(n, k // g) * 0.01, g)
            w = dispatch.repack_q4(blocks, dtype, dev)
            x = torch.randn(1, k, device=dev, dtype=dtype)
            ms = median_ms(lambda: dispatch.w4a16_matmul(x, w), reps=a.reps)
            report(f"int4 {name}", w.nbytes + (k + n) * x.element_size(), ms)
            w8 = dispatch.repack_q8(Q8Blocks(torch.randint(-127, 128, (n, k), dtype=torch.int8),
                                             torch.rand(n, k // 32) * 0.01, 32), torch.float16, dev)
            ms = median_ms(lambda: dispatch.w8a16_matmul(x, w8), reps=a.reps)
            report(f"int8 {name}", w8.nbytes + (k + n) * x.element_size(), ms)
            del w8
            dense = w.dequantize().to(dtype)
            ms = median_ms(lambda: torch.nn.functional.linear(x, dense), reps=a.reps)
            report(f"{dtype} F.linear {name} (reference)", dense.numel() * dense.element_size(), ms)
            del dense, w


if __name__ == "__main__":
    main()
