"""Our GGUF parser must read every file exactly as gguf.GGUFReader does, without using it, and refuse damage."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter

from edgeserve.errors import ModelLoadError
from edgeserve.loaders.gguf_file import GGUFFile
from edgeserve.loaders.gguf_parse import parse_gguf

from support.gguf_writer import finish

# --- comparison against the reference reader ---


def reference_metadata(reader: GGUFReader) -> dict[str, Any]:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def flatten(value: Any) -> Any:
    """GGUFReader.contents() flattens arrays of arrays into one list; ours keeps them nested."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        return [x for inner in value for x in flatten(inner)]
    return value


def assert_same_value(key: str, ours: Any, ref: Any) -> None:
    ours = flatten(ours)
    assert type(ours) is type(ref), (key, type(ours), type(ref))
    if isinstance(ref, list):
        assert len(ours) == len(ref), key
        for i, (a, b) in enumerate(zip(ours, ref)):
            assert type(a) is type(b) and a == b, (key, i, a, b)
    else:
        assert ours == ref, (key, ours, ref)


def assert_same_as_reader(path: Path) -> GGUFFile:
    """GGUFFile over `path` equals GGUFReader: metadata key by key and element by element, tensor infos,
    offsets and raw data views."""
    ours, reader = GGUFFile(path), GGUFReader(path)
    ref = reference_metadata(reader)
    assert list(ours.metadata) == list(ref)
    for key in ref:
        assert_same_value(key, ours.metadata[key], ref[key])
    assert ours.tensor_names() == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = ours.tensor_info(t.name)
        assert info.shape == tuple(reversed(t.shape.tolist())), t.name
        assert info.qtype == t.tensor_type.name, t.name
        assert info.n_bytes == t.n_bytes, t.name
        assert info.data_offset == t.data_offset, t.name
        raw = ours.raw(t.name)
        assert (raw.dtype, raw.shape) == (t.data.dtype, t.data.shape), t.name
        assert np.array_equal(raw, t.data), t.name
        assert not raw.flags.writeable
    layout = parse_gguf(path.read_bytes(), str(path))  # over a bytes buffer: the same layout
    assert layout.data_offset == reader.data_offset
    assert layout.alignment == reader.alignment
    assert layout.tensors == ours._tensors
    return ours


@pytest.fixture
def no_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail loudly if the load path touches gguf.GGUFReader."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("gguf.GGUFReader used on the load path")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    monkeypatch.setattr(gguf.gguf_reader, "GGUFReader", refuse)


def test_default_model_matches_reader(default_model_path: Path) -> None:
    f = assert_same_as_reader(default_model_path)
    assert len(f.metadata["tokenizer.ggml.tokens"]) == 49152
    assert len(f.metadata["tokenizer.ggml.merges"]) > 40000
    assert isinstance(f.metadata["tokenizer.ggml.token_type"], list)  # callers get lists, as before


def test_load_path_does_not_use_gguf_reader(default_model_path: Path, no_reader: None) -> None:
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    f = GGUFFile(default_model_path)
    assert f.architecture == "llama"
    lm = load_model(resolve(str(default_model_path)), dtype="float32")
    assert lm.tokenizer.vocab_size == 49152


# --- small files written by GGUFWriter: every value type, several tensor types, alignment 64 ---

SCALARS: list[tuple[str, Any, GGUFValueType]] = [
    ("t.u8", 255, GGUFValueType.UINT8),
    ("t.i8", -128, GGUFValueType.INT8),
    ("t.u16", 65535, GGUFValueType.UINT16),
    ("t.i16", -32768, GGUFValueType.INT16),
    ("t.u32", 4_000_000_000, GGUFValueType.UINT32),
    ("t.i32", -2_000_000_000, GGUFValueType.INT32),
    ("t.u64", (1 << 64) - 1, GGUFValueType.UINT64),
    ("t.i64", -(1 << 63), GGUFValueType.INT64),
    ("t.f32", 0.1, GGUFValueType.FLOAT32),  # not exact in float32: both must give the same double
    ("t.f64", -1e300, GGUFValueType.FLOAT64),
    ("t.bool_true", True, GGUFValueType.BOOL),
    ("t.bool_false", False, GGUFValueType.BOOL),
    ("t.str", "héllo wörld ▁ 🙂", GGUFValueType.STRING),
    ("t.str_empty", "", GGUFValueType.STRING),
]
ARRAYS: list[tuple[str, list[Any], GGUFValueType]] = [
    ("a.u8", [0, 1, 255], GGUFValueType.UINT8),
    ("a.i8", [-128, 0, 127], GGUFValueType.INT8),
    ("a.u16", [0, 65535], GGUFValueType.UINT16),
    ("a.i16", [-32768, 32767], GGUFValueType.INT16),
    ("a.u32", [0, 4_000_000_000], GGUFValueType.UINT32),
    ("a.i32", [-2_000_000_000, 7], GGUFValueType.INT32),
    ("a.u64", [0, (1 << 64) - 1], GGUFValueType.UINT64),
    ("a.i64", [-(1 << 63), (1 << 63) - 1], GGUFValueType.INT64),
    ("a.f32", [0.1, -2.5, 3e38], GGUFValueType.FLOAT32),
    ("a.f64", [0.1, -1e300], GGUFValueType.FLOAT64),
    ("a.bool", [True, False, True], GGUFValueType.BOOL),
    ("a.str", ["a", "", "ü▁", "<|im_end|>"], GGUFValueType.STRING),
]
NESTED: list[tuple[str, list[Any]]] = [
    ("n.int", [[1, 2], [3], [4, 5, 6]]),
    ("n.str", [["a", "b"], ["c"]]),
    ("n.float", [[0.5], [1.5, -2.0]]),
]
TENSOR_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]


def write_all_types(path: Path, endian: GGUFEndian = GGUFEndian.LITTLE) -> Path:
    rng = np.random.default_rng(1)
    w = GGUFWriter(path, arch="llama", endianess=endian)
    w.add_custom_alignment(64)
    for key, value, vtype in SCALARS:
        w.add_key_value(key, value, vtype)
    for key, values, vtype in ARRAYS:
        w.add_key_value(key, values, GGUFValueType.ARRAY, sub_type=vtype)
    for key, nested in NESTED:
        w.add_array(key, nested)
    w.add_tensor("odd.f32", rng.standard_normal(7).astype(np.float32))  # 28 bytes: the next tensor is padded
    w.add_tensor("blk.0.F32", rng.standard_normal((3, 256)).astype(np.float32))
    w.add_tensor("blk.1.F16", rng.standard_normal((3, 256)).astype(np.float16))
    for i, name in enumerate(TENSOR_TYPES[2:], 2):  # block types: any bytes will do for the layout
        qtype = GGMLQuantizationType[name]
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (3, 256 // block_size * type_size), dtype=np.uint8)
        w.add_tensor(f"blk.{i}.{name}", blocks, raw_dtype=qtype)
    w.add_tensor("scalar.i32", np.arange(24, dtype=np.int32).reshape(2, 3, 4))
    finish(w)
    return path


def test_every_value_and_tensor_type_matches_reader(tmp_path: Path) -> None:
    f = assert_same_as_reader(write_all_types(tmp_path / "all.gguf"))
    for key, value, _ in SCALARS:
        assert f.metadata[key] == value or key == "t.f32", key
    assert f.metadata["t.f32"] == float(np.float32(0.1))
    for key, values, vtype in ARRAYS:
        expected = np.array(values, dtype=np.float32).tolist() if vtype == GGUFValueType.FLOAT32 else values
        assert f.metadata[key] == expected, key
    for key, nested in NESTED:
        assert f.metadata[key] == nested, key  # the inner arrays keep their boundaries
    assert f.metadata["general.alignment"] == 64
    offsets = [f.tensor_info(n).data_offset for n in f.tensor_names()]
    assert all(o % 64 == 0 for o in offsets) and offsets[1] - offsets[0] == 64
    assert {f.tensor_info(n).qtype for n in f.tensor_names()} == {*TENSOR_TYPES, "I32"}
    assert f.tensor_info("scalar.i32").shape == (2, 3, 4)
    assert f.raw("scalar.i32").tolist() == np.arange(24).reshape(2, 3, 4).tolist()


def test_parser_types(tmp_path: Path) -> None:
    """Numeric arrays come out of the parser as numpy arrays (one copy, no per-element objects),
    string arrays as lists of str; GGUFFile turns the arrays into lists for its callers."""
    layout = parse_gguf(write_all_types(tmp_path / "all.gguf").read_bytes())
    for key, values, vtype in ARRAYS:
        value = layout.metadata[key]
        if vtype == GGUFValueType.STRING:
            assert value == values
        else:
            assert isinstance(value, np.ndarray) and value.ndim == 1 and value.flags.owndata, key
            assert value.dtype == GGUFReader.gguf_scalar_to_np[vtype], key
    assert layout.version == 3 and layout.byte_order == "<" and layout.alignment == 64


def test_big_endian_file_matches_reader(tmp_path: Path) -> None:
    f = assert_same_as_reader(write_all_types(tmp_path / "be.gguf", GGUFEndian.BIG))
    assert f.metadata["a.i64"] == [-(1 << 63), (1 << 63) - 1]
    assert f.raw("scalar.i32").tolist() == np.arange(24).reshape(2, 3, 4).tolist()


# --- hand-built files: what GGUFWriter will not write (empty arrays) and damage ---


def gstr(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return gstr(key) + struct.pack("<I", vtype) + payload


def array(itype: int, count: int, items: bytes = b"") -> bytes:
    return struct.pack("<IQ", itype, count) + items


def tensor_info(name: str, dims: tuple[int, ...], qtype: int, offset: int) -> bytes:
    return gstr(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, qtype, offset)


def gguf_bytes(kvs: Sequence[bytes], infos: Sequence[bytes] = (), data: bytes = b"", version: int = 3) -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", version, len(infos), len(kvs)) + b"".join(kvs) + b"".join(infos)
    return head + bytes(-len(head) % 32) + data


def write(tmp_path: Path, content: bytes) -> Path:
    path = tmp_path / "hand.gguf"
    path.write_bytes(content)
    return path


def test_empty_arrays_match_reader(tmp_path: Path) -> None:
    kvs = [kv("general.architecture", 8, gstr("llama"))]
    kvs += [kv(f"e.{t}", 9, array(t, 0)) for t in (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12)]
    kvs.append(kv("e.nested", 9, array(9, 2, array(4, 0) + array(4, 1, struct.pack("<I", 7)))))
    kvs.append(kv("e.outer", 9, array(9, 0)))
    path = write(tmp_path, gguf_bytes(kvs, [tensor_info("w", (4,), 0, 0)], np.arange(4, dtype=np.float32).tobytes()))
    f = assert_same_as_reader(path)
    assert all(f.metadata[f"e.{t}"] == [] for t in (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12))
    assert f.metadata["e.nested"] == [[], [7]] and f.metadata["e.outer"] == []
    assert f.raw("w").tolist() == [0.0, 1.0, 2.0, 3.0]


GOOD = [kv("general.architecture", 8, gstr("llama"))]
DAMAGED: dict[str, tuple[bytes, str]] = {
    "string array count past the end": (
        gguf_bytes([*GOOD, kv("tokenizer.ggml.tokens", 9, array(8, 1 << 60, gstr("a")))]), "truncated"),
    "numeric array count past the end": (
        gguf_bytes([*GOOD, kv("tokenizer.ggml.scores", 9, array(6, 1 << 61, bytes(8)))]), "truncated"),
    "nested array count past the end": (gguf_bytes([*GOOD, kv("n", 9, array(9, 1 << 58))]), "truncated"),
    "string length past the end": (
        gguf_bytes([*GOOD, kv("tokenizer.ggml.tokens", 9, array(8, 2, gstr("a") + struct.pack("<Q", 1 << 62)))]),
        "truncated"),
    "key length past the end": (gguf_bytes([struct.pack("<Q", (1 << 64) - 1) + bytes(16)]), "truncated"),
    "array of unknown type": (
        gguf_bytes([*GOOD, kv("x", 9, array(13, 1, bytes(8)))]), "corrupt.*unknown value type 13"),
    "invalid UTF-8 in a token": (
        gguf_bytes([*GOOD, kv("tokenizer.ggml.tokens", 9, array(8, 2, gstr("a") + gstr(b"\xff\xfe")))]),
        "corrupt.*string #1 is not valid UTF-8"),
    "invalid UTF-8 in a key": (gguf_bytes([kv(b"k\xff", 8, gstr("v"))]), "corrupt.*metadata key #0 is not valid UTF-8"),
    "duplicate key": (gguf_bytes([*GOOD, *GOOD]), "corrupt.*appears twice"),
    "arrays nested too deep": (
        gguf_bytes([*GOOD, kv("deep", 9, array(9, 1) * 40 + array(4, 0))]), "corrupt.*nests arrays"),
    "alignment not a power of two": (
        gguf_bytes([*GOOD, kv("general.alignment", 4, struct.pack("<I", 48))]), "corrupt.*power of two"),
    "alignment not uint32": (
        gguf_bytes([*GOOD, kv("general.alignment", 10, struct.pack("<Q", 64))]), "corrupt.*expected uint32"),
    "dimension count past the end": (
        gguf_bytes(GOOD, [gstr("w") + struct.pack("<I", 1 << 31) + bytes(24)]), "truncated"),
    "quantized row not a whole block": (
        gguf_bytes(GOOD, [tensor_info("w", (33, 1), GGMLQuantizationType.Q8_0, 0)], bytes(4096)),
        "corrupt.*multiple of its 32-value block"),
    "duplicate tensor": (gguf_bytes(GOOD, [tensor_info("w", (4,), 0, 0)] * 2, bytes(16)), "corrupt.*appears twice"),
    "tensor dims past the end": (
        gguf_bytes(GOOD, [tensor_info("w", (1 << 40, 1 << 20), 0, 0)], bytes(16)), "truncated.*'w' ends at byte"),
    "tensor offset past the end": (
        gguf_bytes(GOOD, [tensor_info("w", (4,), 0, 1 << 63)], bytes(16)), "truncated.*'w' ends at byte"),
    "version 1": (gguf_bytes(GOOD, version=1), "version 1 is not supported"),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_damaged_file_is_a_clear_load_error(tmp_path: Path, case: str) -> None:
    content, message = DAMAGED[case]
    with pytest.raises(ModelLoadError, match=message):
        GGUFFile(write(tmp_path, content))
    with pytest.raises(ModelLoadError, match=message):
        parse_gguf(content)


def test_every_cut_of_every_type_is_a_load_error(tmp_path: Path) -> None:
    """Cut the all-types file (nested arrays, strings, every scalar) at every byte of its header section."""
    data = write_all_types(tmp_path / "all.gguf").read_bytes()
    end = parse_gguf(data).data_offset
    for offset in range(0, end + 1):
        with pytest.raises(ModelLoadError, match="truncated|empty"):
            parse_gguf(data[:offset], "cut")
