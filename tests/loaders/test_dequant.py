"""Our GGUF dequantization must equal gguf.quants.dequantize bit for bit, through GGUFFile."""

from __future__ import annotations

import warnings
from math import prod
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from edgeserve.errors import ModelLoadError, UnsupportedModelError
from edgeserve.loaders import dequant
from edgeserve.loaders.dequant import BLOCK_LAYOUTS, SUPPORTED_QTYPES, dequantize, q4_blocks
from edgeserve.loaders.gguf_file import GGUFFile, check_supported_qtype

from support.gguf_writer import write_raw_tensors

FLOAT_TYPES = ("F32", "F16", "BF16")
BLOCK32_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4")  # gguf can quantize these
RANDOM_ONLY32 = ("IQ4_NL",)
K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")

# Byte offsets of the fp16 fields inside one block; every other byte of a block is a valid code,
# so random bytes with finite fp16 scales are a valid (and adversarial) block.
FP16_FIELDS = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "IQ4_NL": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "IQ4_XS": (0,),
    "TQ1_0": (52,),
    "MXFP4": (),
}
# Byte offsets of E8M0 exponent fields, kept to 2^-20 .. 2^-1 here so every value is finite (tests/loaders/test_mxfp4.py
# covers every exponent byte).
EXPONENT_FIELDS = {"MXFP4": (0,)}
EXTRA_LAYOUTS = {"TQ1_0": (256, 54)}

FLOAT_SHAPES = [(7,), (5, 12), (2, 3, 8)]
BLOCK32_SHAPES = [(64,), (3, 96), (2, 2, 32)]
K_SHAPES = [(256,), (3, 512), (2, 2, 256)]


def layout(qtype: str) -> tuple[int, int]:
    return BLOCK_LAYOUTS.get(qtype) or EXTRA_LAYOUTS[qtype]


def random_blocks(qtype: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random stored bytes for `shape` (torch order), with finite fp16 scale fields."""
    block, size = layout(qtype)
    n_blocks = prod(shape) // block
    blocks = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        scales = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16)
        blocks[:, off : off + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    for off in EXPONENT_FIELDS.get(qtype, ()):
        blocks[:, off] = rng.integers(108, 128, n_blocks, dtype=np.uint8)
    return blocks.reshape(*shape[:-1], shape[-1] // block * size)


def stored(qtype: str, shape: tuple[int, ...], source: str, seed: int = 0) -> np.ndarray:
    """What a GGUF writer stores for a tensor of `shape`: quantized random floats, or random blocks."""
    rng = np.random.default_rng(seed)
    if source == "random":
        return random_blocks(qtype, shape, rng)
    values = rng.standard_normal(shape).astype(np.float32)
    if qtype == "F32":
        return values
    if qtype == "F16":
        return values.astype(np.float16)
    return quants.quantize(values, GGMLQuantizationType[qtype])


def reference(data: np.ndarray, qtype: str) -> torch.Tensor:
    return torch.from_numpy(np.array(quants.dequantize(data, GGMLQuantizationType[qtype]), dtype=np.float32))


CASES = (
    [(q, s, "quantize") for q in FLOAT_TYPES for s in FLOAT_SHAPES]
    + [(q, s, src) for q in BLOCK32_TYPES for s in BLOCK32_SHAPES for src in ("quantize", "random")]
    + [(q, s, "random") for q in RANDOM_ONLY32 for s in BLOCK32_SHAPES]
    + [(q, s, "random") for q in K_TYPES for s in K_SHAPES]
)


@pytest.mark.parametrize("qtype,shape,source", CASES)
def test_load_tensor_matches_gguf(tmp_path: Path, qtype: str, shape: tuple[int, ...], source: str) -> None:
    data = stored(qtype, shape, source)
    f = GGUFFile(write_raw_tensors(tmp_path / "t.gguf", {"w": (data, qtype), "other": (stored("F32", (4,), "quantize"), "F32")}))
    info = f.tensor_info("w")
    assert (info.qtype, info.shape) == (qtype, shape)
    expected = reference(data, qtype)
    assert expected.shape == shape  # gguf's numpy shape is torch order (ggml's `shape` reversed)
    got = f.load_tensor("w")
    assert got.dtype == torch.float32 and got.shape == shape
    assert torch.equal(got, expected)
    assert torch.isfinite(got).all()  # guards against comparing NaN patterns by accident


def test_all_supported_types_are_covered() -> None:
    assert {c[0] for c in CASES} == set(SUPPORTED_QTYPES)


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_QTYPES))
def test_chunked_decode_matches(monkeypatch: pytest.MonkeyPatch, qtype: str) -> None:
    """Slicing the work into chunks (with a partial last one) must not change the result."""
    monkeypatch.setattr(dequant, "_CHUNK_ELEMENTS", 96)
    shape = (3, 512) if qtype in K_TYPES else (7, 96)
    data = stored(qtype, shape, "quantize" if qtype in FLOAT_TYPES else "random", seed=1)
    assert torch.isfinite(reference(data, qtype)).all()
    assert torch.equal(dequantize(data, qtype, shape), reference(data, qtype))


def test_read_only_input_is_not_wrapped() -> None:
    data = stored("Q4_1", (4, 64), "random")
    data.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = dequantize(data, "Q4_1", (4, 64))
    out += 1  # the result is our own memory, writable
    assert torch.equal(out - 1, reference(data, "Q4_1"))


def test_wrong_byte_count_is_a_load_error() -> None:
    data = stored("Q8_0", (2, 64), "random")
    with pytest.raises(ModelLoadError, match="Q8_0"):
        dequantize(data[:, :-1], "Q8_0", (2, 64))


Q4_CASES = [
    ("Q4_0", (4, 64), "quantize"),
    ("Q4_0", (2, 3, 96), "random"),
    ("Q4_1", (4, 64), "quantize"),
    ("Q4_1", (5, 32), "random"),
    ("Q4_K", (3, 512), "random"),
    ("Q4_K", (1, 256), "random"),
]


@pytest.mark.parametrize("qtype,shape,source", Q4_CASES)
def test_q4_blocks_reconstruct_dequantized(tmp_path: Path, qtype: str, shape: tuple[int, ...], source: str) -> None:
    data = stored(qtype, shape, source, seed=2)
    f = GGUFFile(write_raw_tensors(tmp_path / "q4.gguf", {"w": (data, qtype)}))
    q, scale, offset = q4_blocks(f.raw("w"), qtype, shape)
    rows, cols = prod(shape[:-1]), shape[-1]
    assert q.dtype == torch.uint8 and q.shape == (rows, cols)
    assert int(q.max()) <= 15
    assert scale.dtype == offset.dtype == torch.float32
    assert scale.shape == offset.shape == (rows, cols // 32)
    rebuilt = (q.float().view(rows, -1, 32) * scale.unsqueeze(-1) + offset.unsqueeze(-1)).reshape(shape)
    expected = f.load_tensor("w")
    # fp16 scales times 4-bit codes are exact in float32, so this is exact, not just close
    assert torch.equal(rebuilt, expected), f"max abs diff {(rebuilt - expected).abs().max().item()}"


def test_q4_blocks_refuses_other_types() -> None:
    with pytest.raises(UnsupportedModelError, match="Q8_0"):
        q4_blocks(stored("Q8_0", (1, 32), "random"), "Q8_0", (1, 32))


@pytest.mark.parametrize("qtype,source", [("TQ1_0", "random")])
def test_unsupported_type_is_refused_by_name(tmp_path: Path, qtype: str, source: str) -> None:
    shape = (2, 256)
    data = stored(qtype, shape, source)
    f = GGUFFile(write_raw_tensors(tmp_path / "u.gguf", {"blk.0.w": (data, qtype)}))
    info = f.tensor_info("blk.0.w")
    assert info.qtype == qtype
    with pytest.raises(UnsupportedModelError, match=rf"'blk\.0\.w'.*{qtype}"):
        check_supported_qtype(info.qtype, "blk.0.w")
    with pytest.raises(UnsupportedModelError, match=qtype):
        f.load_tensor("blk.0.w")
    with pytest.raises(UnsupportedModelError, match=qtype):
        dequantize(f.raw("blk.0.w"), qtype, shape)
