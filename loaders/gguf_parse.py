"""Parse a GGUF (v2/v3) file's layout: header, metadata key/values, tensor infos and where tensor data starts.

Works over any buffer (an mmap of the file, bytes) and reads only the header section; tensor data is never
touched. Every length is checked against the bytes left before anything is allocated, so a damaged file
fails with a ModelLoadError that says what is wrong.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from math import prod
from typing import Any, Literal, NoReturn, Union

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from edgeserve.errors import ModelLoadError

Buffer = Union[bytes, bytearray, memoryview, mmap.mmap]

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_HEADER_SIZE = 24  # magic, u32 version, u64 tensor count, u64 metadata key count
# Smallest possible encodings, used to reject counts that cannot fit in the file before parsing.
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, 1-byte value (empty key)
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset (empty name, no dims)

# GGUF value types (gguf.GGUFValueType) -> struct format of a fixed-size value.
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_UINT32 = 4
# Real files nest arrays at most once; the cap keeps a hostile file from recursing without bound.
_MAX_ARRAY_DEPTH = 8


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file and how it is stored."""

    name: str
    shape: tuple[int, ...]  # torch order: (rows, cols) for a matrix
    qtype: str  # ggml type name: F32, F16, Q4_1, ...
    n_bytes: int
    data_offset: int  # absolute byte offset of its data in the file


@dataclass(frozen=True)
class GGUFLayout:
    """Everything in a GGUF file but the tensor data.

    Metadata values: int / float / bool / str scalars; numeric arrays as 1-D numpy arrays (native byte order,
    owning their memory), string arrays as list[str], arrays of arrays as lists of those.
    """

    version: int
    byte_order: Literal["<", ">"]
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]  # in file order
    alignment: int
    data_offset: int  # where the tensor data section starts


def parse_gguf(buf: Buffer, source: str = "<buffer>") -> GGUFLayout:
    """Parse the GGUF layout in `buf`; `source` names the file in error messages."""
    return _Parser(buf, source).parse()


class _Parser:
    def __init__(self, buf: Buffer, source: str):
        self.buf = buf
        self.source = source
        self.size = len(buf)
        self.pos = 0
        self.order: Literal["<", ">"] = "<"

    def parse(self) -> GGUFLayout:
        version, n_tensors, n_kv = self._header()
        metadata: dict[str, Any] = {}
        alignment = DEFAULT_ALIGNMENT
        for i in range(n_kv):
            key = self._string(f"metadata key #{i}")
            if key in metadata:
                self._corrupt(f"metadata key {key!r} appears twice")
            vtype = self._u32(f"metadata key {key!r}")
            metadata[key] = self._value(vtype, f"metadata key {key!r}", 0)
            if key == "general.alignment":
                alignment = self._alignment(vtype, metadata[key])
        infos = [self._tensor_info(i) for i in range(n_tensors)]
        data_offset = -(-self.pos // alignment) * alignment
        tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, raw_type, offset in infos:
            if name in tensors:
                self._corrupt(f"tensor {name!r} appears twice")
            tensors[name] = info = self._tensor(name, dims, raw_type, data_offset + offset)
            if info.data_offset + info.n_bytes > self.size:
                raise ModelLoadError(
                    f"{self.source} is truncated: tensor {name!r} ends at byte {info.data_offset + info.n_bytes}, "
                    f"file has {self.size} bytes"
                )
        return GGUFLayout(version, self.order, metadata, tensors, alignment, data_offset)

    def _header(self) -> tuple[int, int, int]:
        source, size = self.source, self.size
        magic = bytes(self.buf[:4])
        if size == 0:
            raise ModelLoadError(f"{source} is empty (0 bytes), not a GGUF file")
        if magic != GGUF_MAGIC:
            if size < 4 and GGUF_MAGIC.startswith(magic):
                raise ModelLoadError(f"{source} is truncated: only {size} bytes, shorter than the GGUF header")
            # not the file's bytes: a path may lead (through a symlink) to a file its owner never meant to show
            raise ModelLoadError(f"{source} is not a GGUF file (it does not start with the GGUF magic)")
        if size < _HEADER_SIZE:
            raise ModelLoadError(
                f"{source} is truncated: only {size} bytes, shorter than the {_HEADER_SIZE}-byte GGUF header"
            )
        (version,) = struct.unpack_from("<I", self.buf, 4)
        if version & 0xFFFF == 0:  # written on a big-endian machine
            self.order = ">"
            (version,) = struct.unpack_from(">I", self.buf, 4)
        if version not in GGUF_VERSIONS:
            raise ModelLoadError(
                f"{source}: GGUF version {version} is not supported "
                f"(supported: {', '.join(map(str, GGUF_VERSIONS))})"
            )
        n_tensors, n_kv = struct.unpack_from(self.order + "QQ", self.buf, 8)
        if _HEADER_SIZE + n_tensors * _MIN_TENSOR_INFO_BYTES + n_kv * _MIN_KV_BYTES > size:
            raise ModelLoadError(
                f"{source} is truncated or corrupt: its header lists {n_tensors} tensors and {n_kv} metadata keys, "
                f"more than fit in {size} bytes"
            )
        self.pos = _HEADER_SIZE
        return version, n_tensors, n_kv

    # --- primitives: each checks the bytes left, then advances self.pos ---

    def _need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise ModelLoadError(
                f"{self.source} is truncated: {what} needs {n} bytes at offset {self.pos}, file has {self.size} bytes"
            )

    def _fixed(self, fmt: str, what: str) -> Any:
        fmt = self.order + fmt
        n = struct.calcsize(fmt)
        self._need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def _u32(self, what: str) -> int:
        return self._fixed("I", what)

    def _u64(self, what: str) -> int:
        return self._fixed("Q", what)

    def _string(self, what: str) -> str:
        n = self._u64(what)
        self._need(n, what)
        start = self.pos
        self.pos += n
        return self._decode(self.buf[start : self.pos], what)

    def _decode(self, raw: Any, what: str) -> str:
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as e:
            self._corrupt(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})")

    def _corrupt(self, why: str) -> NoReturn:
        raise ModelLoadError(f"{self.source} is corrupt: {why}")

    # --- values ---

    def _value(self, vtype: int, what: str, depth: int) -> Any:
        fmt = _FIXED.get(vtype)
        if fmt is not None:
            return self._fixed(fmt, what)
        if vtype == _STRING:
            return self._string(what)
        if vtype == _ARRAY:
            return self._array(what, depth + 1)
        self._corrupt(f"{what} has unknown value type {vtype}")

    def _array(self, what: str, depth: int) -> np.ndarray | list[Any]:
        if depth > _MAX_ARRAY_DEPTH:
            self._corrupt(f"{what} nests arrays more than {_MAX_ARRAY_DEPTH} deep")
        itype = self._u32(what)
        count = self._u64(what)
        fmt = _FIXED.get(itype)
        if fmt is not None:
            dtype = np.dtype(self.order + fmt)
            self._need(count * dtype.itemsize, what)
            values = np.frombuffer(self.buf, dtype, count, self.pos).astype(dtype.newbyteorder("="))
            self.pos += count * dtype.itemsize
            return values
        if itype == _STRING:
            return self._strings(count, what)
        if itype == _ARRAY:
            self._need(count * 12, what)  # each inner array has at least its type and count
            return [self._array(what, depth + 1) for _ in range(count)]
        self._corrupt(f"{what} is an array of unknown value type {itype}")

    def _strings(self, count: int, what: str) -> list[str]:
        # The hot loop of a vocabulary (~100k strings): locals only, no per-element method calls.
        self._need(count * 8, what)  # each string has at least its length
        buf, pos, size = self.buf, self.pos, self.size
        unpack_len = struct.Struct(self.order + "Q").unpack_from
        out: list[str] = []
        append = out.append
        for i in range(count):
            if pos + 8 <= size:
                (n,) = unpack_len(buf, pos)
                if pos + 8 + n <= size:
                    pos += 8
                    try:
                        append(str(buf[pos : pos + n], "utf-8"))
                    except UnicodeDecodeError as e:
                        self._corrupt(f"{what}: string #{i} is not valid UTF-8 ({e.reason} at byte {e.start})")
                    pos += n
                    continue
            self.pos = pos
            self._string(f"{what}: string #{i}")  # raises: the string runs past the end
        self.pos = pos
        return out

    def _alignment(self, vtype: int, value: Any) -> int:
        if vtype != _UINT32:
            self._corrupt(f"general.alignment has value type {vtype}, expected uint32")
        if value == 0 or value & (value - 1):
            self._corrupt(f"general.alignment is {value}, not a power of two")
        return value

    # --- tensor infos ---

    def _tensor_info(self, i: int) -> tuple[str, tuple[int, ...], int, int]:
        what = f"tensor info #{i}"
        name = self._string(what)
        what = f"tensor info #{i} ({name!r})"
        n_dims = self._u32(what)
        self._need(n_dims * 8, what)
        dims = struct.unpack_from(f"{self.order}{n_dims}Q", self.buf, self.pos)
        self.pos += n_dims * 8
        raw_type = self._u32(what)
        offset = self._u64(what)
        return name, dims, raw_type, offset

    def _tensor(self, name: str, dims: tuple[int, ...], raw_type: int, data_offset: int) -> GGUFTensorInfo:
        try:
            qtype = GGMLQuantizationType(raw_type)
            block_size, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            self._corrupt(f"tensor {name!r} has unknown type {raw_type}")
        if block_size > 1 and (not dims or dims[0] % block_size):
            self._corrupt(
                f"tensor {name!r} of type {qtype.name} has a row of {dims[0] if dims else 0} values, "
                f"not a multiple of its {block_size}-value block"
            )
        n_bytes = prod(dims) * type_size // block_size
        return GGUFTensorInfo(name, tuple(reversed(dims)), qtype.name, n_bytes, data_offset)
