"""W4A16: the repack from Q4Blocks, and the Triton GEMV and tiled matmuls against the torch twin."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICES, assert_close, kernel_device
from support.quant_checks import (assert_linear_keeps_leading_dims_and_bias, assert_repacked_matches_twin,
                                  twin_cases)

from edgeserve.kernels import dispatch
from edgeserve.kernels.formats.quant_linear import Q4Blocks
from edgeserve.kernels.formats.w4a16 import W4A16Weight, pack_int4, repack_q4, w4a16_matmul


def q4_blocks(n: int, k: int, group: int, seed: int = 0) -> Q4Blocks:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=gen) * 0.05 + 0.01
    offset = -8 * scale + torch.randn(n, k // group, generator=gen) * 0.01
    return Q4Blocks(q, scale, offset, group)


def test_pack_layout_low_nibble_first():
    q = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15]], dtype=torch.uint8)
    word = pack_int4(q)
    assert word.dtype == torch.int32 and word.shape == (1, 1)
    assert word.item() & 0xFFFFFFFF == 0xF7654321


def test_repack_round_trip():
    blocks = q4_blocks(37, 96, 32, seed=1)
    w = repack_q4(blocks, torch.float32)
    assert torch.equal(w.unpack(), blocks.q)
    assert torch.allclose(w.dequantize(), blocks.dequantize(), atol=1e-6)
    assert w.nbytes == 37 * 96 // 2 + 2 * 37 * 3 * 4
    with pytest.raises(ValueError):
        repack_q4(q4_blocks(4, 36, 12), torch.float16)  # group size not a multiple of 8


# (M, N, K, group): M <= 4 takes the GEMV path, larger M the tiled one; odd M and N
SHAPES = [(1, 67, 96, 32), (3, 40, 256, 128), (4, 33, 128, 64), (5, 67, 96, 32), (33, 70, 128, 32), (70, 19, 64, 32)]


@twin_cases(SHAPES)
def test_w4a16_matches_twin(device, dtype, m, n, k, group):
    assert_repacked_matches_twin(q4_blocks(n, k, group, seed=m), repack_q4, device, dtype, m, dispatch.w4a16_matmul,
                                 w4a16_matmul)


@pytest.mark.parametrize("device", DEVICES)
def test_linear_with_bias_and_leading_dims(device):
    """dispatch.linear takes a W4A16Weight like any weight: leading dims kept, bias added."""
    assert_linear_keeps_leading_dims_and_bias(q4_blocks(24, 64, 32, seed=9), repack_q4, kernel_device(device))


def test_twin_is_dispatched_without_triton():
    w = repack_q4(q4_blocks(8, 32, 32), torch.float32)
    x = torch.randn(2, 32)
    with dispatch.force_backend("torch"):
        y = dispatch.linear(x, w)
    assert isinstance(w, W4A16Weight)
    assert torch.allclose(y, x @ w.dequantize().t(), atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_w,split_target", [(8, 64), (16, 24), (32, 1)])
def test_gemv_split_k_matches_twin(device, block_w, split_target):
    """The GEMV split along K (float32 partials added atomically) gives the unsplit result, including a last
    split shorter than the others."""

    device = kernel_device(device)
    # after the skip: a Triton kernel module needs triton to import
    from edgeserve.kernels.triton.w4a16 import GemvConfig, gemv
    n, k, group = 19, 352, 32  # 44 packed words a row: splits of 8 or 16 words leave a short last one
    w = repack_q4(q4_blocks(n, k, group, seed=5), torch.float32, device)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(6)).to(device)
    y = torch.full((2, n), float("nan"), device=device)
    gemv(x, w, y, GemvConfig(block_n=8, block_w=block_w, num_warps=2, programs_per_sm=split_target))
    expected = x.cpu() @ w.to("cpu").dequantize().t()
    assert_close(y, expected, torch.float32, scale=float((x.cpu().abs() @ w.to("cpu").dequantize().abs().t()).max()) / 8)


@pytest.mark.parametrize("device", DEVICES)
def test_gemv_row_does_not_depend_on_the_batch(device):
    """A row's GEMV result is the same, bit for bit, alone and with other rows beside it (the K split follows
    the weight, not the batch), which keeps greedy decoding batch-invariant on this path."""
    device = kernel_device(device)
    w = repack_q4(q4_blocks(40, 512, 128, seed=7), torch.bfloat16, device)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16).to(device)
    with dispatch.force_backend("triton"):
        alone = dispatch.w4a16_matmul(x[:1], w)
        batched = dispatch.w4a16_matmul(x, w)
    assert torch.equal(alone[0], batched[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["w4a16", "w8a16"])
def test_batch_invariant_mode_row_does_not_depend_on_the_batch(device, kind, monkeypatch):
    """EDGESERVE_BATCH_INVARIANT=1: a row's result is the same, bit for bit, whether it is computed alone, beside
    a few rows (the GEMV sizes) or beside many (the tiled sizes), because every size takes one tiled path."""
    from edgeserve.kernels.formats.quant_linear import Q8Blocks
    from edgeserve.kernels.formats.w8a16 import repack_q8

    device = kernel_device(device)
    monkeypatch.setenv("EDGESERVE_BATCH_INVARIANT", "1")
    if kind == "w4a16":
        w, matmul = repack_q4(q4_blocks(72, 256, 32, seed=3), torch.bfloat16, device), dispatch.w4a16_matmul
    else:
        gen = torch.Generator().manual_seed(4)
        blocks = Q8Blocks(torch.randint(-127, 128, (72, 256), generator=gen, dtype=torch.int8),
                          torch.rand(72, 256 // 32, generator=gen) * 0.01 + 0.001, 32)
        w, matmul = repack_q8(blocks, torch.bfloat16, device), dispatch.w8a16_matmul
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to(device)
    with dispatch.force_backend("triton"):
        alone = matmul(x[:1], w)
        results = [matmul(x[:m], w) for m in (3, 7, 40)]
    for batched in results:
        assert torch.equal(alone[0], batched[0])
    assert_close(alone, x[:1].float().cpu() @ w.to("cpu").dequantize().float().t(), torch.bfloat16,
                 scale=float((x[:1].float().cpu().abs() @ w.to("cpu").dequantize().abs().float().t()).max()) / 8)
