"""Damaged or wrong model files must fail with a ModelLoadError that says what is wrong."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from edgeserve.errors import ModelLoadError
from edgeserve.loaders.gguf_file import GGUFFile

from support.gguf_writer import finish


def write_valid(path: Path) -> Path:
    """A small but complete GGUF: string, int and array metadata, an F32 and a Q8_0 tensor."""
    rng = np.random.default_rng(0)
    writer = GGUFWriter(path, arch="llama")
    writer.add_name("tiny test model")
    writer.add_context_length(128)
    writer.add_token_list(["<s>", "</s>", "hello", "world"])
    writer.add_token_scores([0.0, 0.0, -1.5, -2.5])
    writer.add_tensor("norm.weight", rng.standard_normal(8).astype(np.float32))
    q8 = quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.w", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    finish(writer)
    return path


@pytest.fixture
def valid(tmp_path: Path) -> Path:
    return write_valid(tmp_path / "valid.gguf")


CUT_PLACES = [
    "header: half the magic",
    "header: magic only",
    "header: in the version",
    "header: in the tensor count",
    "header: in the metadata count",
    "metadata: in the first key",
    "metadata: in a string value",
    "metadata: in a string array",
    "metadata: in a float array",
    "tensor info: at its start",
    "tensor info: in the last entry",
    "tensor info: before the data padding",
    "tensor data: at its start",
    "tensor data: in the first tensor",
    "tensor data: in the last tensor",
    "tensor data: one byte short",
]


def cut_points(path: Path) -> dict[str, int]:
    """Byte offsets inside the header, the metadata/tensor-info section and the tensor data of `path`."""
    r = GGUFReader(path)
    name_field = r.fields["general.name"]
    tokens = r.fields["tokenizer.ggml.tokens"]
    scores = r.fields["tokenizer.ggml.scores"]
    first_info, last_info = r.tensors[0].field, r.tensors[-1].field
    info_end = last_info.offset + sum(int(p.nbytes) for p in last_info.parts)
    first, last = r.tensors[0], r.tensors[-1]
    return {
        "header: half the magic": 2,
        "header: magic only": 4,
        "header: in the version": 6,
        "header: in the tensor count": 12,
        "header: in the metadata count": 20,
        "metadata: in the first key": name_field.offset + 10,
        "metadata: in a string value": name_field.offset + sum(int(p.nbytes) for p in name_field.parts) - 3,
        "metadata: in a string array": tokens.offset + sum(int(p.nbytes) for p in tokens.parts) - 2,
        "metadata: in a float array": scores.offset + sum(int(p.nbytes) for p in scores.parts) - 6,
        "tensor info: at its start": first_info.offset,
        "tensor info: in the last entry": last_info.offset + 9,
        "tensor info: before the data padding": info_end,
        "tensor data: at its start": r.data_offset,
        "tensor data: in the first tensor": first.data_offset + int(first.n_bytes) // 2,
        "tensor data: in the last tensor": last.data_offset + int(last.n_bytes) // 2,
        "tensor data: one byte short": last.data_offset + int(last.n_bytes) - 1,
    }


def test_valid_file_loads(valid: Path) -> None:
    f = GGUFFile(valid)
    assert f.architecture == "llama"
    assert f.metadata["general.name"] == "tiny test model"
    assert f.tensor_names() == ["norm.weight", "blk.0.w"]
    assert f.load_tensor("blk.0.w").shape == (4, 64)
    assert f.load_tensor("norm.weight").dtype == torch.float32


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found") as e:
        GGUFFile(tmp_path / "absent.gguf")
    assert "absent.gguf" in str(e.value)


def test_directory_is_not_a_model_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a file"):
        GGUFFile(tmp_path)


def test_empty_file(tmp_path: Path) -> None:
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="empty"):
        GGUFFile(tmp_path / "empty.gguf")


@pytest.mark.parametrize(
    "content",
    [
        b"ggjt" + bytes(60),  # legacy GGML
        struct.pack("<Q", 2) + b"{}" + bytes(30),  # safetensors
        b"<!DOCTYPE html><html>not found</html>",  # an error page saved as the model
        b"GX",
    ],
    ids=["ggml", "safetensors", "html", "short"],
)
def test_wrong_magic(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        GGUFFile(path)


@pytest.mark.parametrize("where", CUT_PLACES)
def test_truncated(valid: Path, tmp_path: Path, where: str) -> None:
    points = cut_points(valid)
    assert list(points) == CUT_PLACES
    offset = points[where]
    data = valid.read_bytes()
    assert 0 < offset < len(data)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:offset])
    with pytest.raises(ModelLoadError, match="truncated"):
        GGUFFile(cut)


def test_every_cut_is_a_load_error(valid: Path, tmp_path: Path) -> None:
    """Whatever byte the file ends at, opening it raises ModelLoadError and nothing else."""
    data = valid.read_bytes()
    last = cut_points(valid)["tensor data: one byte short"]
    cut = tmp_path / "cut.gguf"
    for offset in range(1, last + 1):
        cut.write_bytes(data[:offset])
        with pytest.raises(ModelLoadError, match="truncated|not a GGUF"):
            GGUFFile(cut)


def patched(valid: Path, tmp_path: Path, offset: int, new: bytes) -> Path:
    data = bytearray(valid.read_bytes())
    data[offset : offset + len(new)] = new
    path = tmp_path / "patched.gguf"
    path.write_bytes(bytes(data))
    return path


def test_unsupported_version(valid: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="version 99"):
        GGUFFile(patched(valid, tmp_path, 4, struct.pack("<I", 99)))


@pytest.mark.parametrize("offset", [8, 16], ids=["tensor count", "metadata count"])
def test_impossible_counts(valid: Path, tmp_path: Path, offset: int) -> None:
    with pytest.raises(ModelLoadError, match="corrupt"):
        GGUFFile(patched(valid, tmp_path, offset, struct.pack("<Q", 1 << 60)))


def test_unknown_value_type(valid: Path, tmp_path: Path) -> None:
    field = GGUFReader(valid).fields["general.name"]
    type_offset = field.offset + sum(int(p.nbytes) for p in field.parts[:2])
    with pytest.raises(ModelLoadError, match="corrupt"):
        GGUFFile(patched(valid, tmp_path, type_offset, struct.pack("<I", 200)))


def test_unknown_tensor_type(valid: Path, tmp_path: Path) -> None:
    info = GGUFReader(valid).tensors[-1].field
    type_offset = info.offset + sum(int(p.nbytes) for p in info.parts[:4])
    with pytest.raises(ModelLoadError, match="corrupt"):
        GGUFFile(patched(valid, tmp_path, type_offset, struct.pack("<I", 250)))


def test_missing_tensor(valid: Path) -> None:
    f = GGUFFile(valid)
    for call in (f.load_tensor, f.tensor_info, f.raw):
        with pytest.raises(ModelLoadError, match="'nope' is missing"):
            call("nope")
