"""W8A16: the layout from Q8Blocks (and real Q8_0 bytes), the Triton GEMV and tiled matmuls against the torch twin,
dispatch routing, and GGUF Q8_0 loading as W8A16 on the Triton path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from kernel_utils import DEVICES, assert_close, kernel_device
from support.quant_checks import (assert_linear_keeps_leading_dims_and_bias, assert_repacked_matches_twin,
                                  twin_cases)
from tiny_gguf import write_tiny_llama

from edgeserve.kernels import dispatch
from edgeserve.kernels.formats import w8a16 as w8a16_module
from edgeserve.kernels.formats.quant_linear import Q8Blocks
from edgeserve.kernels.formats.w8a16 import W8A16Weight, repack_q8, w8a16_matmul
from edgeserve.loaders.dequant import dequantize, q8_blocks
from edgeserve.models.attention import ContiguousKV
from edgeserve.models.load import load_model
from edgeserve.registry import resolve


def q8_random(n: int, k: int, group: int, seed: int = 0) -> Q8Blocks:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int16).to(torch.int8)
    scale = torch.rand(n, k // group, generator=gen) * 0.01 + 0.001
    return Q8Blocks(q, scale, group)


def q8_0_bytes(n: int, k: int, seed: int = 0) -> np.ndarray:
    """What a GGUF writer stores for a random [n, k] float tensor quantized to Q8_0."""
    values = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return quants.quantize(values, GGMLQuantizationType.Q8_0)


def test_repack_round_trip():
    blocks = q8_random(37, 96, 32, seed=1)
    w = repack_q8(blocks, torch.float32)
    assert w.qweight.dtype == torch.int8 and torch.equal(w.qweight, blocks.q)
    assert (w.out_features, w.in_features, w.group_size) == (37, 96, 32)
    assert torch.equal(w.dequantize(), blocks.dequantize())
    assert w.nbytes == 37 * 96 + 37 * 3 * 4
    assert repack_q8(blocks).scales.dtype == torch.float16
    with pytest.raises(ValueError):
        repack_q8(q8_random(4, 96, 48), torch.float16)  # group size not a power of two


def test_real_q8_0_bytes_equal_the_dequantized_matmul():
    """A weight built from stored Q8_0 bytes is exactly `dequantize(raw, "Q8_0")`, and so is its matmul."""
    n, k = 24, 160
    raw = q8_0_bytes(n, k, seed=3)
    ref = dequantize(raw, "Q8_0", (n, k))
    w = repack_q8(Q8Blocks(*q8_blocks(raw, (n, k)), 32), torch.float16)  # Q8_0's scales are float16: exact
    assert torch.equal(w.dequantize(), ref)
    x = torch.randn(5, k)
    with dispatch.force_backend("torch"):
        y = dispatch.linear(x, w)
    torch.testing.assert_close(y, x @ ref.t(), rtol=1e-5, atol=1e-5)


# (M, N, K, group): M <= 4 takes the GEMV path, larger M the tiled one; odd M and N; groups below, at and above
# the kernels' BLOCK_K (128 for GEMV, 32 tiled)
SHAPES = [(1, 67, 96, 32), (3, 40, 256, 32), (4, 33, 128, 64), (1, 24, 512, 256), (5, 67, 96, 32),
          (17, 70, 160, 32), (33, 19, 512, 256), (70, 24, 64, 32)]


@twin_cases(SHAPES)
def test_w8a16_matches_twin(device, dtype, m, n, k, group):
    assert_repacked_matches_twin(q8_random(n, k, group, seed=m), repack_q8, device, dtype, m, dispatch.w8a16_matmul,
                                 w8a16_matmul)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_real_q8_0_weight_with_float16_scales(device, dtype, m):
    """The loader's layout (float16 scales whatever the activation dtype) from stored Q8_0 bytes, both paths."""
    device = kernel_device(device)
    n, k = 40, 192
    raw = q8_0_bytes(n, k, seed=m)
    ref = dequantize(raw, "Q8_0", (n, k))
    w = repack_q8(Q8Blocks(*q8_blocks(raw, (n, k)), 32), torch.float16, device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).to(device)
    with dispatch.force_backend("triton"):
        y = dispatch.linear(x, w)
    assert y.dtype == dtype and y.shape == (m, n)
    expected = x.float().cpu() @ ref.t()
    assert_close(y, expected, dtype, scale=float((x.float().cpu().abs() @ ref.abs().t()).max()) / 8)


@pytest.mark.parametrize("device", DEVICES)
def test_linear_with_bias_and_leading_dims(device):
    """dispatch.linear takes a W8A16Weight like any weight: leading dims kept, bias added."""
    assert_linear_keeps_leading_dims_and_bias(q8_random(24, 64, 32, seed=9), repack_q8, kernel_device(device))


def _spy(monkeypatch, module, calls: list[str], label: str) -> None:
    real = module.w8a16_matmul

    def spy(x, weight, *args):
        calls.append(label)
        return real(x, weight, *args)

    monkeypatch.setattr(module, "w8a16_matmul", spy)


def test_cpu_dispatch_runs_the_twin(monkeypatch):
    """On CPU under auto (and forced torch) dispatch.linear runs the torch twin."""
    monkeypatch.delenv("EDGESERVE_KERNELS", raising=False)
    calls: list[str] = []
    _spy(monkeypatch, w8a16_module, calls, "twin")
    w = repack_q8(q8_random(8, 64, 32), torch.float32)
    x = torch.randn(2, 64)
    y = dispatch.linear(x, w)
    with dispatch.force_backend("torch"):
        dispatch.linear(x, w)
    assert calls == ["twin", "twin"]
    assert isinstance(w, W8A16Weight)
    assert torch.allclose(y, x @ w.dequantize().t(), atol=1e-5)


def test_forced_triton_dispatch_runs_the_kernel(monkeypatch):
    kernel_device("cpu")
    from edgeserve.kernels.triton import w8a16 as triton_w8a16

    calls: list[str] = []
    _spy(monkeypatch, triton_w8a16, calls, "triton")
    _spy(monkeypatch, w8a16_module, calls, "twin")
    w = repack_q8(q8_random(8, 64, 32), torch.float32)
    with dispatch.force_backend("triton"):
        dispatch.linear(torch.randn(2, 64), w)
    assert calls == ["triton"]


# --- GGUF Q8_0 through the loader -----------------------------------------------------------------------------

IDS = torch.arange(3, 40)


def _matrices(model) -> list:
    return [w for layer in model.layers for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]


def _logits(model) -> torch.Tensor:
    c = model.config
    kv = ContiguousKV(c.num_layers, len(IDS), c.num_kv_heads, c.head_dim, model.dtype, device=model.device)
    ids = IDS.to(model.device)
    return model.logits(model.forward(ids, torch.arange(len(IDS), device=model.device), kv)).float().cpu()


@pytest.fixture
def q8_gguf(tmp_path):
    return resolve(str(write_tiny_llama(tmp_path / "q8.gguf", qtype="Q8_0", hidden=64, ffn=128)))


def test_q8_0_loads_as_w8a16_where_triton_runs(q8_gguf, monkeypatch):
    """Where the loader would run Triton (faked here on CPU), Q8_0 matrices stay int8 codes + float16 scales:
    exactly the stored weights, even with bfloat16 compute (where the CPU path would requantize per row)."""
    from edgeserve.models import llama

    exact = load_model(q8_gguf, dtype="float32")
    assert isinstance(exact.model.layers[0].down, torch.Tensor)  # without Triton, float32 compute is dense
    monkeypatch.setattr(llama, "use_triton", lambda device: True)
    for dtype in ("float32", "bfloat16"):
        lm = load_model(q8_gguf, dtype=dtype)
        weights = _matrices(lm.model)
        assert all(isinstance(w, W8A16Weight) for w in weights)
        assert all(w.qweight.dtype == torch.int8 and w.scales.dtype == torch.float16 and w.group_size == 32
                   for w in weights)
        layer, ref = lm.model.layers[1], exact.model.layers[1]
        for name in ("qkv", "o_proj", "gate_up", "down"):  # fused and unpermuted like the float weights
            assert torch.equal(getattr(layer, name).dequantize(), getattr(ref, name)), name


def test_q8_0_model_through_the_kernel_matches_the_exact_model(q8_gguf):
    """The whole W8A16 path (the loader's choice and every kernel in Triton's interpreter) gives the exact logits."""
    kernel_device("cpu")
    exact = load_model(q8_gguf, dtype="float32")
    with dispatch.force_backend("triton"):
        lm = load_model(q8_gguf, dtype="float32")
        assert isinstance(lm.model.layers[0].gate_up, W8A16Weight)
        out = _logits(lm.model)
    torch.testing.assert_close(out, _logits(exact.model), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_q8_0_on_cuda_stays_8_bit_and_agrees_with_cpu(q8_gguf, monkeypatch):
    kernel_device("cuda")
    monkeypatch.delenv("EDGESERVE_KERNELS", raising=False)
    if not dispatch.use_triton("cuda"):
        pytest.skip("this GPU takes the torch twins under auto")
    exact = load_model(q8_gguf, dtype="float32")
    fast = load_model(q8_gguf, device="cuda")
    w = fast.model.layers[0].gate_up
    assert isinstance(w, W8A16Weight) and w.qweight.is_cuda and w.qweight.dtype == torch.int8
    ref, out = _logits(exact.model), _logits(fast.model)
    # test_quantize's yardstick: half-precision activations on a random tiny model move logits by a few %
    assert (ref - out).abs().mean() < 0.1 * ref.abs().mean()
    assert (0.5 * (ref.softmax(-1) - out.softmax(-1)).abs().sum(-1)).max() < 0.2
