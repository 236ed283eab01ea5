"""Weights that stay quantized at load: GGUF Q8_0 as int8, Q4_K as int4, and `quantize="int4"` (group-wise
asymmetric INT4 of a float model, optionally with AWQ-style activation-aware scaling)."""

from __future__ import annotations

import logging

import pytest
import torch

from edgeserve.errors import EdgeserveError
from edgeserve.kernels import dispatch
from edgeserve.kernels.cpu.native import BlockWeight
from edgeserve.kernels.formats.quant_linear import Int4Weight, Int8Weight, Q4Blocks
from edgeserve.loaders.quantize import Int4QuantizingWeights, awq_search, group_for
from edgeserve.models.attention import ContiguousKV
from edgeserve.models.load import load_model
from edgeserve.registry import resolve
from kernel_utils import kernel_device
from tiny_gguf import write_tiny_llama

IDS = torch.arange(3, 40)


def logits(model) -> torch.Tensor:
    c = model.config
    kv = ContiguousKV(c.num_layers, len(IDS), c.num_kv_heads, c.head_dim, model.dtype)
    return model.logits(model.forward(IDS, torch.arange(len(IDS)), kv))


def assert_close_logits(ref: torch.Tensor, out: torch.Tensor, rel: float = 0.1) -> None:
    # same yardstick as test_fast_path: bf16 rounding on a random model moves logits by ~5% on average;
    # a wrong packing, scale or offset moves them by about their own size
    assert (ref - out).abs().mean() < rel * ref.abs().mean()
    assert (0.5 * (ref.softmax(-1) - out.softmax(-1)).abs().sum(-1)).max() < 0.2


def matrices(model) -> list:
    return [w for layer in model.layers for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]


# --- the quantizer --------------------------------------------------------------------------------------------

def test_quantize_q4_is_within_half_a_step():
    w = torch.randn(16, 256) * torch.linspace(0.1, 3, 256)
    b = Q4Blocks.quantize(w, 64)
    assert b.q.dtype == torch.uint8 and int(b.q.max()) <= 15 and b.scale.shape == (16, 4)
    err = (b.dequantize() - w).abs().view(16, 4, 64)
    assert (err <= b.scale.unsqueeze(-1) / 2 + 1e-6).all()
    groups = w.view(16, 4, 64)
    # group-wise asymmetric: each group's min and max are exact
    assert torch.allclose(b.dequantize().view(16, 4, 64).amin(-1), groups.amin(-1), atol=1e-6)
    assert torch.allclose(b.dequantize().view(16, 4, 64).amax(-1), groups.amax(-1), atol=1e-5)
    with pytest.raises(ValueError, match="multiple of the group size"):
        Q4Blocks.quantize(torch.randn(2, 96), 64)


def test_regroup_is_exact_and_cpu_int4_takes_any_multiple_of_32():
    b = Q4Blocks.quantize(torch.randn(16, 192), 64)
    per_row = Q4Blocks(b.q, b.scale[:, :1].contiguous(), b.offset[:, :1].contiguous(), 192)  # per-channel group
    assert torch.equal(per_row.regroup(32).dequantize(), per_row.dequantize())
    x = torch.randn(3, 192, dtype=torch.bfloat16)
    y = Int4Weight(per_row, torch.bfloat16).matmul(x).float()  # 192 is no CPU op group size: regrouped to 64
    ref = x.float() @ per_row.dequantize().t()
    assert (y - ref).abs().max() < 0.02 * ref.abs().max()


def test_group_for_falls_back_to_a_divisor():
    assert group_for(1536, 128) == 128 and group_for(576, 128) == 64 and group_for(96, 128) == 32
    assert group_for(48, 128) is None and group_for(4096, 64) == 64


def test_awq_search_helps_with_outlier_channels():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 128, generator=gen)
    x[:, :4] *= 30  # a few channels with large activations, as in real LLMs
    w = torch.randn(64, 128, generator=gen)
    s = awq_search(x, w, 64)
    ref = x @ w.t()

    def err(scale):
        return (x / scale @ Q4Blocks.quantize(w * scale, 64).dequantize().t() - ref).pow(2).mean()

    assert err(s) < 0.8 * err(torch.ones(128))
    assert s[:4].mean() > s[4:].mean()


# --- GGUF types that stay quantized ---------------------------------------------------------------------------

def test_q8_0_stays_8_bit(tmp_path):
    path = write_tiny_llama(tmp_path / "q8.gguf", qtype="Q8_0", hidden=64, ffn=128)
    fast, exact = (load_model(resolve(str(path)), dtype=d) for d in ("auto", "float32"))
    assert all(isinstance(w, (Int8Weight, BlockWeight)) for w in matrices(fast.model))  # native: Q8_0 blocks
    assert_close_logits(logits(exact.model), logits(fast.model))


def test_q4_k_stays_4_bit_on_cpu_and_in_the_w4a16_layout(tmp_path):
    path = write_tiny_llama(tmp_path / "q4k.gguf", qtype="Q4_K", hidden=256, ffn=256, heads=4, kv_heads=2)
    fast, exact = (load_model(resolve(str(path)), dtype=d) for d in ("auto", "float32"))
    assert all(isinstance(w, (Int4Weight, BlockWeight)) for w in matrices(fast.model))  # native: Q4_K blocks
    assert_close_logits(logits(exact.model), logits(fast.model))
    kernel_device("cpu")  # the rest runs Triton on CPU tensors: only in its interpreter (skips in a GPU process)
    with dispatch.force_backend("triton"):  # the GPU path's repack, built here for CPU tensors
        lm = load_model(resolve(str(path)), dtype="float32")
    w = lm.model.layers[0].down
    assert isinstance(w, dispatch.W4A16Weight) and w.group_size == 32
    assert torch.equal(w.dequantize(), exact.model.layers[0].down)


# --- quantize="int4" ------------------------------------------------------------------------------------------

def test_quantize_int4_packs_a_float_model(tmp_path):
    path = write_tiny_llama(tmp_path / "f16.gguf", qtype="F16", hidden=64, ffn=128)
    exact = load_model(resolve(str(path)), dtype="float32")
    q = load_model(resolve(str(path)), quantize="int4")
    assert all(isinstance(w, Int4Weight) for w in matrices(q.model))
    assert {w.group_size for w in matrices(q.model)} == {64, 128}  # 128 where in_features allows, else 64
    # float32 compute with --quantize: the same int4 values, dequantized (what the GPU kernels compute)
    q32 = load_model(resolve(str(path)), dtype="float32", quantize="int4")
    down = exact.model.layers[1].down
    assert torch.equal(q32.model.layers[1].down, Q4Blocks.quantize(down, 128).dequantize())
    assert_close_logits(logits(q32.model), logits(q.model))  # the packed CPU path computes those values
    # a random tiny model is chaotic: 4-bit rounding of every matrix moves its logits by about half their size
    # (GGUF Q4_1 of the same weights: ~0.6), a broken quantizer by more than their size
    ref = logits(exact.model)
    assert (logits(q32.model) - ref).abs().mean() < 0.8 * ref.abs().mean()
    kernel_device("cpu")  # the rest runs Triton on CPU tensors: only in its interpreter (skips in a GPU process)
    with dispatch.force_backend("triton"):
        tq = load_model(resolve(str(path)), dtype="float32", quantize="int4", quantize_group_size=32)
    assert isinstance(tq.model.layers[1].down, dispatch.W4A16Weight) and tq.model.layers[1].down.group_size == 32
    assert torch.equal(tq.model.layers[1].down.dequantize(), Q4Blocks.quantize(down, 32).dequantize())
    x = torch.randn(2, 128)
    with dispatch.force_backend("triton"):  # the W4A16 kernel (Triton's interpreter here) on a quantized weight
        y = dispatch.linear(x, tq.model.layers[1].down)
    torch.testing.assert_close(y, x @ Q4Blocks.quantize(down, 32).dequantize().t(), rtol=1e-4, atol=1e-4)


def test_quantize_on_a_quantized_gguf_loads_it_as_stored(tmp_path, caplog):
    path = write_tiny_llama(tmp_path / "q4.gguf", qtype="Q4_0", hidden=64, ffn=128)
    with caplog.at_level(logging.WARNING):
        lm = load_model(resolve(str(path)), quantize="int4")
    assert "already quantized (Q4_0)" in caplog.text
    plain = load_model(resolve(str(path)))
    assert torch.equal(logits(lm.model), logits(plain.model))


def test_bad_quantize_options_are_refused(tmp_path):
    from edgeserve.cli import build_parser
    from edgeserve.server import ServerConfig

    path = write_tiny_llama(tmp_path / "f32.gguf", hidden=64, ffn=128)
    with pytest.raises(EdgeserveError, match="group size must be one of 32, 64, 128, 256, got 100"):
        load_model(resolve(str(path)), quantize="int4", quantize_group_size=100)
    with pytest.raises(EdgeserveError, match="quantize must be one of int4"):
        load_model(resolve(str(path)), quantize="int8")
    with pytest.raises(ValueError, match="group size"):
        ServerConfig(quantize="int4", quantize_group_size=48)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--quantize-group-size", "100", "hi"])
    args = build_parser().parse_args(["serve", "--quantize", "int4", "--quantize-group-size", "64"])
    assert (args.quantize, args.quantize_group_size, args.quantize_calibration) == ("int4", 64, None)


def test_awq_scales_fold_exactly(tmp_path):
    """The scales folded into norms / up rows / matrix columns leave the float model's output unchanged."""
    from edgeserve.loaders.gguf_file import GGUFFile
    from edgeserve.loaders.gguf_weights import GGUFWeights
    from edgeserve.models.config import config_from_gguf
    from edgeserve.models.llama import LlamaModel

    path = write_tiny_llama(tmp_path / "f32.gguf", hidden=64, ffn=128)
    gguf = GGUFFile(path)
    config = config_from_gguf(gguf.metadata, set(gguf.tensor_names()))
    weights = GGUFWeights(gguf, config.num_heads, config.num_kv_heads)
    gen = torch.Generator().manual_seed(1)
    scales = {i: {"attn": torch.rand(64, generator=gen) + 0.5, "mlp": torch.rand(64, generator=gen) + 0.5,
                  "down": torch.rand(128, generator=gen) + 0.5} for i in range(config.num_layers)}
    ref = LlamaModel.from_weights(config, weights, keep_int4=False)
    folded = LlamaModel.from_weights(config, Int4QuantizingWeights(weights, 32, scales), keep_int4=False)
    assert not torch.allclose(folded.layers[0].input_norm, ref.layers[0].input_norm)
    torch.testing.assert_close(logits(folded), logits(ref), rtol=1e-4, atol=1e-4)


def test_quantize_with_calibration_text(tmp_path):
    from edgeserve.loaders.gguf_file import GGUFFile
    from edgeserve.loaders.gguf_weights import GGUFWeights
    from edgeserve.models.calibrate import awq_scales

    path = write_tiny_llama(tmp_path / "f32.gguf", hidden=64, ffn=128)
    text = tmp_path / "calib.txt"
    text.write_text("hello hello the quick brown fox jumps over the lazy dog. " * 8)
    q = load_model(resolve(str(path)), quantize="int4", quantize_calibration=str(text))
    assert all(isinstance(w, Int4Weight) for w in matrices(q.model))
    exact = load_model(resolve(str(path)), dtype="float32")
    ref = logits(exact.model)
    q32 = load_model(resolve(str(path)), dtype="float32", quantize="int4", quantize_calibration=str(text))
    assert (logits(q32.model) - ref).abs().mean() < 0.8 * ref.abs().mean()
    ids = exact.tokenizer.encode(text.read_text())
    weights = GGUFWeights(GGUFFile(path), exact.config.num_heads, exact.config.num_kv_heads)
    scales = awq_scales(exact.config, weights, ids, 128, torch.float32, torch.device("cpu"))
    assert sorted(scales) == [0, 1] and scales[1]["down"].shape == (128,) and scales[0]["attn"].shape == (64,)
    assert all(torch.isfinite(s).all() and (s > 0).all() for layer in scales.values() for s in layer.values())
    with pytest.raises(EdgeserveError, match="cannot read the calibration text"):
        load_model(resolve(str(path)), quantize="int4", quantize_calibration=str(tmp_path / "missing.txt"))
