"""Checks shared by the weight-only quantized formats (W4A16, W8A16): the Triton matmul against its torch twin (with
the parametrization of that test), and dispatch.linear taking the packed weight like any other."""

from __future__ import annotations

from typing import Callable, Sequence

import pytest
import torch
from kernel_utils import DEVICES, assert_close, kernel_device

from edgeserve.kernels import dispatch


def assert_triton_matches_twin(w, m: int, dtype: torch.dtype, device: str, kernel: Callable, twin: Callable) -> None:
    """`kernel` (dispatched under a forced Triton backend) on a random [m, K] input equals `twin` on CPU float32,
    within the dtype's tolerance scaled by the sum of |terms|."""
    x = torch.randn(m, w.in_features, generator=torch.Generator().manual_seed(m + 1)).to(dtype).to(device)
    with dispatch.force_backend("triton"):
        y = kernel(x, w)
    assert y.dtype == dtype and y.shape == (m, w.out_features)
    expected = twin(x.float().cpu(), w.to("cpu"))
    # accumulation error scales with the sum of |terms|, not with the (partly cancelling) result
    scale = float((x.float().cpu().abs() @ w.to("cpu").dequantize().abs().t()).max()) / 8
    assert_close(y, expected, dtype, scale=scale)


def twin_cases(shapes: Sequence[tuple[int, int, int, int]]) -> Callable:
    """Parametrize a matches-twin test over every device, fp32/fp16/bf16 and each (M, N, K, group) of `shapes`."""
    def mark(test: Callable) -> Callable:
        test = pytest.mark.parametrize("m,n,k,group", shapes)(test)
        test = pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                                       ids=["fp32", "fp16", "bf16"])(test)
        return pytest.mark.parametrize("device", DEVICES)(test)
    return mark


def assert_repacked_matches_twin(blocks, repack: Callable, device: str, dtype: torch.dtype, m: int, kernel: Callable,
                                 twin: Callable) -> None:
    """`blocks` repacked in `dtype` on the kernel device for `device`: assert_triton_matches_twin on an [m, K] input."""
    device = kernel_device(device)
    assert_triton_matches_twin(repack(blocks, dtype, device), m, dtype, device, kernel, twin)


def assert_linear_keeps_leading_dims_and_bias(blocks, repack: Callable, device: str) -> None:
    """dispatch.linear takes the repacked [24, 64] `blocks` like any weight: leading dims kept, bias added."""
    w = repack(blocks, torch.float32, device)
    x = torch.randn(2, 3, 64).to(device)
    bias = torch.randn(24).to(device)
    with dispatch.force_backend("triton"):
        y = dispatch.linear(x, w, bias)
    expected = x.cpu() @ blocks.dequantize().t() + bias.cpu()
    assert y.shape == (2, 3, 24)
    assert_close(y, expected, torch.float32)
