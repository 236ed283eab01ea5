"""The native bfloat16 matmul (kernels/cpu/src/bf16_matmul.c, kernels/formats/bf16_weight.py) against a float64 product of the
bfloat16-rounded operands: odd shapes (row panels and k-pairs padded), the bias, every tile height, and each row's
result independent of the batch around it."""

from __future__ import annotations

import pytest
import torch

from edgeserve.kernels.formats.bf16_weight import Bf16Weight, bf16_library

pytestmark = pytest.mark.skipif(bf16_library() is None, reason="needs the native library on a CPU with AVX-512 BF16")


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.bfloat16().double() @ w.bfloat16().double().T
    return y if b is None else y + b.double()


@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (5, 37, 33), (8, 32, 64), (9, 48, 7), (17, 384, 384), (64, 100, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_float64_product_of_the_rounded_operands(m, n, k, bias):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    got = Bf16Weight(w).matmul(x, b)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    want = _reference(x, w, b)
    # float32 sums of exact products: a relative error of a few float32 steps of the absolute sum
    bound = 1e-5 * (x.bfloat16().double().abs() @ w.bfloat16().double().abs().T).max().item() + 1e-6
    assert (got.double() - want).abs().max().item() <= bound


def test_rows_are_batch_invariant_and_the_weight_round_trips():
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(72, 200, generator=gen), torch.randn(23, 200, generator=gen)
    bw = Bf16Weight(w)
    full = bw.matmul(x)
    for lo, hi in ((0, 1), (3, 11), (5, 23), (8, 16)):  # tiles of 1 to 8 rows over different row groups
        assert torch.equal(bw.matmul(x[lo:hi]), full[lo:hi])
    assert torch.equal(bw.dequantize(), w.bfloat16().float())
    assert bw.matmul(x.reshape(23, 1, 200)).shape == (23, 1, 72)
    assert bw.matmul(x[:0]).shape == (0, 72)


def test_strided_and_bfloat16_inputs_give_the_same_result():
    gen = torch.Generator().manual_seed(4)
    w, x = torch.randn(40, 64, generator=gen), torch.randn(6, 128, generator=gen)
    bw = Bf16Weight(w)
    strided = x[:, ::2]  # not unit-stride: copied first
    assert torch.equal(bw.matmul(strided), bw.matmul(strided.contiguous()))
    assert torch.equal(bw.matmul(strided.bfloat16()), bw.matmul(strided.contiguous()))


def test_a_wrong_width_is_refused():
    with pytest.raises(ValueError, match="features"):
        Bf16Weight(torch.randn(8, 16)).matmul(torch.randn(2, 15))


@pytest.mark.parametrize("rows", [(32, 64, 32), (40, 32, 8)])  # panels joined / packed again
def test_stacked_weights_give_each_parts_bits(rows):
    gen = torch.Generator().manual_seed(sum(rows))
    parts = [Bf16Weight(torch.randn(n, 48, generator=gen)) for n in rows]
    x = torch.randn(11, 48, generator=gen)
    fused = Bf16Weight.stacked(parts)
    assert fused.shape == (sum(rows), 48)
    assert torch.equal(fused.matmul(x), torch.cat([p.matmul(x) for p in parts], dim=1))
    with pytest.raises(ValueError, match="in_features"):
        Bf16Weight.stacked([parts[0], Bf16Weight(torch.randn(32, 16))])
