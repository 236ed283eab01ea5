"""GPU-only kernel checks (skipped without CUDA): auto dispatch picks Triton, and the decode kernels stream
memory at a sane fraction of the measured copy bandwidth (a floor that catches a badly broken kernel, not a target;
benchmarks/kernels/kernels_gpu.py reports the actual figures). The GEMVs are timed inside a CUDA graph, as decode runs them:
timed one eager call at a time, a 30 us kernel measures the host's launch time instead."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import kernel_device

from edgeserve.kernels import dispatch
from edgeserve.kernels.formats.quant_linear import Q4Blocks, Q8Blocks

pytestmark = pytest.mark.gpu
FLOOR = 0.2  # of copy bandwidth (which itself counts read + write bytes)


@pytest.fixture(scope="module")
def copy_gbs() -> float:
    from edgeserve.kernels.triton.bench import copy_bandwidth_gbs

    kernel_device("cuda")
    return copy_bandwidth_gbs("cuda", 1 << 28)


def test_auto_dispatch_picks_triton_on_supported_gpus(monkeypatch):
    kernel_device("cuda")
    monkeypatch.delenv("EDGESERVE_KERNELS", raising=False)
    major, minor = torch.cuda.get_device_capability()
    assert dispatch.use_triton("cuda") is ((7, 5) <= (major, minor) <= (9, 9))


def assert_gemv_bandwidth(label: str, w, kernel, copy_gbs: float) -> None:
    """`kernel` on one row of x against the packed weight `w` (Triton, timed in a CUDA graph) reads the weight's bytes
    at more than FLOOR of the device's copy bandwidth."""
    from edgeserve.kernels.triton.bench import graph_median_ms

    x = torch.randn(1, w.in_features, device="cuda", dtype=dispatch.compute_dtype("cuda"))
    with dispatch.force_backend("triton"):
        ms = graph_median_ms(lambda: kernel(x, w))
    gbs = w.nbytes / (ms * 1e-3) / 1e9
    assert gbs > FLOOR * copy_gbs, f"{label} GEMV at {gbs:.0f} GB/s, copy {copy_gbs:.0f} GB/s"


def test_w4a16_gemv_bandwidth(copy_gbs):
    n, k, g = 14336, 4096, 128
    dtype = dispatch.compute_dtype("cuda")
    blocks = Q4Blocks(torch.randint(0, 16, (n, k), dtype=torch.uint8), torch.rand(n, k // g) * 0.01,
                      torch.randn(n, k // g) * 0.01, g)
    assert_gemv_bandwidth("W4A16", dispatch.repack_q4(blocks, dtype, "cuda"), dispatch.w4a16_matmul, copy_gbs)


def test_w8a16_gemv_bandwidth(copy_gbs):
    n, k, g = 14336, 4096, 32  # GGUF Q8_0's group
    blocks = Q8Blocks(torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n, k // g) * 0.01, g)
    assert_gemv_bandwidth("W8A16", dispatch.repack_q8(blocks, torch.float16, "cuda"), dispatch.w8a16_matmul, copy_gbs)


def test_decode_attention_bandwidth(copy_gbs):
    from edgeserve.kernels.triton.bench import median_ms

    batch, context, heads, kv_heads, d, bs = 8, 4096, 32, 8, 128, 16
    dtype = dispatch.compute_dtype("cuda")
    per_seq = context // bs
    k_cache = torch.randn(batch * per_seq, bs, kv_heads, d, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    meta = dispatch.AttentionMetadata.build([1] * batch, [context] * batch, tables,
                                            [t[-1] * bs + bs - 1 for t in tables], device="cuda")
    q = torch.randn(batch, heads, d, device="cuda", dtype=dtype)
    with dispatch.force_backend("triton"):
        ms = median_ms(lambda: dispatch.paged_attention(q, k_cache, v_cache, meta))
    gbs = 2 * k_cache.numel() * k_cache.element_size() / (ms * 1e-3) / 1e9
    assert gbs > FLOOR * copy_gbs, f"decode attention at {gbs:.0f} GB/s, copy {copy_gbs:.0f} GB/s"
