"""MXFP4 (GGUF tensor type 39, gpt-oss's expert weights): loading bit-equal to gguf-py at every exponent byte,
3-D expert stacks, the native matmul of every variant this CPU runs against a float64 reference (odd row counts,
the _X8 bands, batch invariance, all-zero blocks, extreme exponents), and the path from a GGUF file to a native
BlockWeight or, without the native library, a dense tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from edgeserve.errors import ModelLoadError
from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.cpu.native import FORMATS, BlockTensor, BlockWeight, block_weight
from edgeserve.loaders.dequant import dequantize
from edgeserve.loaders.gguf_file import GGUFFile, check_supported_qtype
from edgeserve.loaders.gguf_weights import GGUFWeights, gguf_blocks

from support.gguf_writer import write_raw_tensors

MXFP4 = GGMLQuantizationType.MXFP4
VARIANTS = cpu_native.supported_variants()


def gguf_dequant(data: np.ndarray) -> np.ndarray:
    """gguf-py's float32 values of MXFP4 blocks (inf where the largest exponents overflow float32)."""
    with np.errstate(over="ignore"):
        return np.asarray(quants.dequantize(data, MXFP4), dtype=np.float32)


def mxfp4_blocks(rows: int, cols: int, gen: np.random.Generator, exponents: tuple[int, int] = (117, 127),
                 codes: np.ndarray | None = None) -> np.ndarray:
    """Random MXFP4 bytes [rows, cols / 32 * 17] with exponent bytes in [lo, hi) and, if given, codes drawn from
    `codes` only."""
    nb = cols // 32
    data = np.empty((rows, nb, 17), dtype=np.uint8)
    data[:, :, 0] = gen.integers(*exponents, size=(rows, nb), dtype=np.uint8)
    pool = np.arange(16, dtype=np.uint8) if codes is None else codes.astype(np.uint8)
    c = gen.choice(pool, size=(rows, nb, 32))
    data[:, :, 1:] = c[:, :, :16] | (c[:, :, 16:] << 4)
    return data.reshape(rows, nb * 17)


def reference(x: torch.Tensor, data: np.ndarray, cols: int) -> torch.Tensor:
    """x @ W.T in float64 from gguf-py's dequantization."""
    w = torch.from_numpy(gguf_dequant(data).reshape(data.shape[0], cols)).double()
    return x.double() @ w.T


@pytest.fixture(scope="module", params=VARIANTS)
def lib(request):
    return cpu_native.load(request.param)


# ---- loading ------------------------------------------------------------------------------------------------


def test_every_exponent_byte_and_code_dequantizes_as_gguf_does():
    """Blocks with each of the 256 exponent bytes (0, 1: subnormal scales; 254, 255: values past float32's range,
    inf as gguf-py gives them) and every code in every position: the same float32 bits as gguf.quants."""
    gen = np.random.default_rng(0)
    data = gen.integers(0, 256, size=(256 * 4, 17), dtype=np.uint8)
    data[:, 0] = np.repeat(np.arange(256, dtype=np.uint8), 4)
    data[::4, 1:] = np.arange(16, dtype=np.uint8) * 0x11  # codes c, c in both nibbles: all 16 codes per exponent
    want = gguf_dequant(data).reshape(-1)
    with np.errstate(over="ignore"):
        got = dequantize(data, "MXFP4", (len(data) * 32,)).numpy()
    assert np.isinf(want).any() and (want[:32 * 8] != 0).any()  # the edges are really exercised
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_quantized_floats_round_trip_through_a_gguf_file(tmp_path):
    values = np.random.default_rng(1).standard_normal((6, 96)).astype(np.float32)
    data = quants.quantize(values, MXFP4)
    f = GGUFFile(write_raw_tensors(tmp_path / "m.gguf", {"w": (data, "MXFP4")}))
    info = f.tensor_info("w")
    assert (info.qtype, info.shape) == ("MXFP4", (6, 96))
    check_supported_qtype(info.qtype, "w")  # accepted, no error
    got = f.load_tensor("w")
    assert torch.equal(got, torch.from_numpy(gguf_dequant(data)))
    assert (got - torch.from_numpy(values)).abs().max() < 0.5 * torch.from_numpy(values).abs().max()


def test_a_3d_expert_stack_loads_whole_and_one_expert_at_a_time(tmp_path):
    gen = np.random.default_rng(2)
    experts, rows, cols = 3, 5, 64
    data = mxfp4_blocks(experts * rows, cols, gen).reshape(experts, rows, cols // 32 * 17)
    f = GGUFFile(write_raw_tensors(tmp_path / "e.gguf", {"blk.0.ffn_down_exps.weight": (data, "MXFP4")}))
    assert f.tensor_info("blk.0.ffn_down_exps.weight").shape == (experts, rows, cols)
    whole = f.load_tensor("blk.0.ffn_down_exps.weight")
    assert whole.shape == (experts, rows, cols)
    assert torch.equal(whole, torch.from_numpy(gguf_dequant(data.reshape(-1, 17))).reshape(experts, rows, cols))
    for e in range(experts):
        part = gguf_blocks(f, "blk.0.ffn_down_exps.weight", e)
        assert part is not None and part.qtype == "MXFP4" and part.shape == (rows, cols)
        assert np.array_equal(part.data.numpy(), data[e])
    with pytest.raises(ModelLoadError, match="3 experts"):
        gguf_blocks(f, "blk.0.ffn_down_exps.weight", 3)
    with pytest.raises(ModelLoadError, match="rows, cols"):
        gguf_blocks(f, "blk.0.ffn_down_exps.weight")


# ---- the native matmul ---------------------------------------------------------------------------------------


def check_close(got: torch.Tensor, x: torch.Tensor, data: np.ndarray, cols: int) -> None:
    """got within the int8 activations' rounding of the float64 reference (per output, relative to |x| @ |W|.T)."""
    want = reference(x, data, cols)
    w_abs = torch.from_numpy(np.abs(gguf_dequant(data).reshape(data.shape[0], cols))).double()
    bound = 0.01 * (x.double().abs() @ w_abs.T) + 1e-30
    assert torch.isfinite(got).all()
    assert ((got.double() - want).abs() <= bound).all(), (got.double() - want).abs().max().item()


@pytest.mark.parametrize("rows", [1, 13, 37, 40])  # 40: the _X8 bands
@pytest.mark.parametrize("batch", [1, 5, 9])
def test_matmul_matches_float64_reference(lib, rows, batch):
    gen = np.random.default_rng(rows * 100 + batch)
    cols = 32 * 11
    data = mxfp4_blocks(rows, cols, gen)
    x = torch.from_numpy(gen.standard_normal((batch, cols)).astype(np.float32))
    w = BlockWeight([BlockTensor("MXFP4", torch.from_numpy(data), cols)], lib)
    assert w.parts[0].qtype == ("MXFP4_X8" if rows % 8 == 0 else "MXFP4")
    check_close(w.matmul(x), x, data, cols)
    check_close(w.matmul(x.bfloat16()), x.bfloat16().float(), data, cols)


@pytest.mark.parametrize("rows", [24, 21])
def test_extreme_exponents(lib, rows):
    """The smallest exponents (e = 0, 1: subnormal scales 2^-128, 2^-127) with ordinary ones, against ordinary
    activations; the largest (e = 254, 255: 2^126, 2^127, with levels 0 and +-1 only so the weights stay finite)
    against activations small enough for finite sums. Row 0 has only e = 0 blocks, row 1 only e = 255 blocks."""
    gen = np.random.default_rng(3)
    cols = 32 * 6
    cases = [((0, 1, 2, 120, 127), 0, 1.0, lambda y: (y != 0).all() and (y.abs() < 1e-36).all()),
             ((120, 127, 200, 254, 255), 255, 1e-3, lambda y: (y.abs() > 1e30).all())]
    for exps, first, x_scale, row0_ok in cases:
        data = mxfp4_blocks(rows, cols, gen, codes=np.array([0, 1, 8, 9])).reshape(rows, 6, 17)  # levels 0, +-1
        data[:, :, 0] = gen.choice(np.array(exps, dtype=np.uint8), size=(rows, 6))
        data[0, :, 0] = first
        data = data.reshape(rows, -1)
        assert np.isfinite(gguf_dequant(data)).all()
        x = torch.from_numpy(gen.standard_normal((3, cols)).astype(np.float32)) * x_scale
        got = BlockWeight([BlockTensor("MXFP4", torch.from_numpy(data), cols)], lib).matmul(x)
        check_close(got, x, data, cols)
        assert row0_ok(got[:, 0]), got[:, 0]


@pytest.mark.parametrize("rows", [16, 9])
def test_all_zero_weights_and_activations(lib, rows):
    gen = np.random.default_rng(4)
    cols = 32 * 4
    data = mxfp4_blocks(rows, cols, gen, codes=np.array([0, 8]))  # +0 and -0 codes, any exponent
    data.reshape(rows, 4, 17)[:, :, 0] = gen.integers(0, 256, size=(rows, 4), dtype=np.uint8)
    w = BlockWeight([BlockTensor("MXFP4", torch.from_numpy(data), cols)], lib)
    x = torch.from_numpy(gen.standard_normal((3, cols)).astype(np.float32))
    assert torch.equal(w.matmul(x), torch.zeros(3, rows))
    other = BlockWeight([BlockTensor("MXFP4", torch.from_numpy(mxfp4_blocks(rows, cols, gen)), cols)], lib)
    assert torch.equal(other.matmul(torch.zeros(2, cols)), torch.zeros(2, rows))


@pytest.mark.parametrize("rows", [101, 96])  # 96: the _X8 bands
def test_rows_are_batch_invariant(lib, rows):
    gen = np.random.default_rng(5)
    cols = 32 * 40
    w = BlockWeight([BlockTensor("MXFP4", torch.from_numpy(mxfp4_blocks(rows, cols, gen)), cols)], lib)
    x = torch.from_numpy(gen.standard_normal((33, cols)).astype(np.float32))
    full = w.matmul(x)
    for i in (0, 17, 32):
        assert torch.equal(w.matmul(x[i:i + 1])[0], full[i])
    for lo, hi in ((5, 12), (1, 3), (20, 23), (8, 16), (0, 33)):
        assert torch.equal(w.matmul(x[lo:hi]), full[lo:hi])


def test_every_variant_agrees_with_the_scalar_one():
    """The SIMD kernels and the portable C sum the same integers per block; only the float order differs."""
    gen = np.random.default_rng(6)
    cols = 32 * 16
    x = torch.from_numpy(gen.standard_normal((7, cols)).astype(np.float32))
    for rows in (33, 32):
        data = torch.from_numpy(mxfp4_blocks(rows, cols, gen))
        base = BlockWeight([BlockTensor("MXFP4", data, cols)], cpu_native.load("scalar")).matmul(x)
        for variant in VARIANTS:
            got = BlockWeight([BlockTensor("MXFP4", data, cols)], cpu_native.load(variant)).matmul(x)
            torch.testing.assert_close(got, base, rtol=1e-5, atol=1e-5 * base.abs().max().item())


@pytest.mark.parametrize("rows", [9, 24])
def test_rows_and_dequantize_are_exact(lib, rows):
    gen = np.random.default_rng(7)
    cols = 32 * 5
    data = mxfp4_blocks(rows, cols, gen, exponents=(0, 254))
    w = BlockWeight([BlockTensor("MXFP4", torch.from_numpy(data), cols)], lib)
    want = torch.from_numpy(gguf_dequant(data).reshape(rows, cols))
    ids = torch.tensor([rows - 1, 0, 3, 3])
    assert torch.equal(w.rows(ids), want[ids])
    assert torch.equal(w.dequantize(), want)


def test_mixed_with_other_formats_in_one_weight(lib):
    from test_cpu_kernels import random_blocks

    gen = np.random.default_rng(8)
    cols = 256 * 2
    parts = [BlockTensor("MXFP4", torch.from_numpy(mxfp4_blocks(16, cols, gen)), cols), random_blocks("Q8_0", 8, cols, gen),
             BlockTensor("MXFP4", torch.from_numpy(mxfp4_blocks(5, cols, gen)), cols)]
    w = BlockWeight(parts, lib)
    assert [p.qtype for p in w.parts] == ["MXFP4_X8", "Q8_0_X8", "MXFP4"]
    x = torch.from_numpy(gen.standard_normal((4, cols)).astype(np.float32))
    want = torch.cat([BlockWeight([p], lib).matmul(x) for p in parts], dim=1)
    assert torch.equal(w.matmul(x), want)


def test_format_table_matches_the_library(lib):
    for name in ("MXFP4", "MXFP4_X8"):
        fid, per, size = FORMATS[name]
        assert (lib.qmm_block_values(fid), lib.qmm_block_bytes(fid)) == (per, size)
    assert lib.qmm_format_count() == max(f[0] for f in FORMATS.values()) + 1


# ---- from a GGUF file to the model's weights ------------------------------------------------------------------


def test_block_weight_over_a_gguf_source_and_the_dense_fallback(tmp_path, monkeypatch):
    gen = np.random.default_rng(9)
    rows, cols = 24, 96
    data = mxfp4_blocks(rows, cols, gen)
    path = write_raw_tensors(tmp_path / "w.gguf", {"blk.0.ffn_down.weight": (data, MXFP4),
                                            "blk.0.ffn_gate_exps.weight": (np.stack([data, data]), MXFP4)})
    source = GGUFWeights(GGUFFile(path), n_heads=2, n_kv_heads=1)
    assert source.stored_quantized() == ["MXFP4"]
    name = "model.layers.0.mlp.down_proj.weight"
    blocks = source.blocks(name)
    assert blocks is not None and blocks.qtype == "MXFP4" and np.array_equal(blocks.data.numpy(), data)
    x = torch.from_numpy(gen.standard_normal((2, cols)).astype(np.float32))
    if cpu_native.available():
        native = block_weight(source, [name], torch.device("cpu"), torch.bfloat16)
        assert isinstance(native, BlockWeight) and native.parts[0].qtype == "MXFP4_X8"
        check_close(native.matmul(x), x, data, cols)
    monkeypatch.setenv("EDGESERVE_NATIVE", "0")
    assert block_weight(source, [name], torch.device("cpu"), torch.bfloat16) is None
    dense = source.get(name, keep_int4=True)  # what the model loads instead: float32 values
    assert isinstance(dense, torch.Tensor)
    assert torch.equal(dense, torch.from_numpy(gguf_dequant(data).reshape(rows, cols)))
