"""Open a GGUF file over mmap: metadata as Python values, tensors on demand.

A model split by llama.cpp's gguf-split (`NAME-00001-of-00003.gguf`, ... with `split.no` / `split.count` /
`split.tensors.count` keys) opens from its first part's path: the metadata comes from the first part and the
tensors from all of them.
"""

from __future__ import annotations

import mmap
import os
import re
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from edgeserve.errors import ModelLoadError, UnsupportedModelError

from edgeserve.kernels.host_pages import release_pages

from .gguf_parse import GGUFTensorInfo, parse_gguf

__all__ = ["GGUFFile", "GGUFTensorInfo", "check_supported_qtype", "gguf_parts", "release_pages"]

# Types whose raw data is typed values; every other type is raw block bytes (as gguf.GGUFReader gives them).
_SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_VALUE_DTYPES = {"F32": "f4", "F16": "f2", "F64": "f8", "I8": "i1", "I16": "i2", "I32": "i4", "I64": "i8"}


class GGUFFile:
    """A GGUF file opened read-only over mmap; nothing is copied until a tensor is asked for."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._map, layout = _open_part(self.path)
        self._byte_order = layout.byte_order
        self._tensors = layout.tensors
        self.metadata: dict[str, Any] = {key: _python(value) for key, value in layout.metadata.items()}
        self._maps = {name: self._map for name in self._tensors}  # the part each tensor's bytes are in
        self.parts = [self.path]
        if int(self.metadata.get("split.count", 1)) > 1:
            self._open_other_parts()

    def _open_other_parts(self) -> None:
        """Map parts 2.. of a split model next to this first part and take their tensors."""
        count = int(self.metadata["split.count"])
        m = _SPLIT_NAME.match(self.path.name)
        if int(self.metadata.get("split.no", 0)) != 0 or m is None or int(m["no"]) != 1:
            raise ModelLoadError(f"{self.path} is not the first part of a split GGUF model "
                                 f"(give the path of NAME-00001-of-{count:05d}.gguf)")
        if int(m["count"]) != count:
            raise ModelLoadError(f"{self.path.name} says the model has {count} parts, its name says {int(m['count'])}")
        for no, part in enumerate(gguf_parts(self.path)[1:], start=2):
            if not part.is_file():
                raise ModelLoadError(f"split GGUF model part {no} of {count} is missing: {part}")
            buf, layout = _open_part(part)
            meta = layout.metadata
            if int(meta.get("split.no", -1)) != no - 1 or int(meta.get("split.count", 0)) != count:
                raise ModelLoadError(f"{part} is not part {no} of {count} of {self.path.name}")
            if layout.byte_order != self._byte_order:
                raise ModelLoadError(f"{part}: byte order differs from the first part's")
            for name, info in layout.tensors.items():
                if name in self._tensors:
                    raise ModelLoadError(f"{part}: tensor {name!r} is also in an earlier part")
                self._tensors[name] = info
                self._maps[name] = buf
            self.parts.append(part)
        expected = self.metadata.get("split.tensors.count")
        if expected is not None and int(expected) != len(self._tensors):
            raise ModelLoadError(f"split GGUF model {self.path.name}: its parts hold {len(self._tensors)} tensors, "
                                 f"split.tensors.count says {expected}")

    @property
    def architecture(self) -> str:
        """The `general.architecture` string (e.g. 'llama', 'qwen2')."""
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelLoadError(f"{self.path}: metadata has no general.architecture")
        return arch

    def tensor_names(self) -> list[str]:
        """Names of all tensors, in file order."""
        return list(self._tensors)

    def tensor_info(self, name: str) -> GGUFTensorInfo:
        """Shape (torch order), storage type, size and file offset of one tensor."""
        try:
            return self._tensors[name]
        except KeyError:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing") from None

    def raw(self, name: str) -> np.ndarray:
        """The tensor's stored values (F32, F16, ...) or block bytes (quantized, BF16), shaped in torch order
        (bytes per row last for block types), as a read-only view into the mmap (no copy)."""
        info = self.tensor_info(name)
        value_dtype = _VALUE_DTYPES.get(info.qtype)
        if value_dtype is not None:
            dtype, shape = np.dtype(self._byte_order + value_dtype), info.shape
        else:
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[info.qtype]]
            dtype, shape = np.dtype(np.uint8), (*info.shape[:-1], info.shape[-1] // block_size * type_size)
        return np.frombuffer(self._maps[name], dtype, prod(shape), info.data_offset).reshape(shape)

    def load_tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One tensor dequantized to `dtype`, in torch order; only this tensor's bytes are read."""
        from .dequant import dequantize

        info = self.tensor_info(name)
        check_supported_qtype(info.qtype, name)
        try:
            values = dequantize(self.raw(name), info.qtype, info.shape)
        except ModelLoadError as e:
            raise ModelLoadError(f"{self.path}: tensor {name!r}: {e}") from None
        return values.to(dtype)


def gguf_parts(path: str | os.PathLike[str]) -> list[Path]:
    """The files of a GGUF model by name: every part of a split model given its first part
    (NAME-00001-of-0000N.gguf), else [path]. Nothing is opened."""
    path = Path(path)
    m = _SPLIT_NAME.match(path.name)
    if m is None or int(m["no"]) != 1:
        return [path]
    count = int(m["count"])
    return [path.with_name(f"{m['stem']}-{no:05d}-of-{count:05d}.gguf") for no in range(1, count + 1)]


def _open_part(path: Path) -> tuple[bytes | mmap.mmap, Any]:
    """Map one GGUF file read-only and parse its layout."""
    if not path.exists():
        raise ModelLoadError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelLoadError(f"model path is not a file: {path}")
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            # mmap refuses an empty file; the parser reports that one itself.
            buf: bytes | mmap.mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    except OSError as e:
        raise ModelLoadError(f"cannot read model file {path}: {e.strerror or e}") from None
    return buf, parse_gguf(buf, str(path))


def _python(value: Any) -> Any:
    """A parsed metadata value as plain Python: numeric arrays become lists (callers expect lists)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list) and value and not isinstance(value[0], str):
        return [_python(v) for v in value]
    return value


def check_supported_qtype(qtype: str, name: str) -> None:
    """Refuse by name a tensor whose storage type we cannot dequantize."""
    from .dequant import SUPPORTED_QTYPES

    if qtype not in SUPPORTED_QTYPES:
        raise UnsupportedModelError(
            f"tensor {name!r} uses quantization type {qtype}, which edgeserve does not support "
            f"(supported: {', '.join(sorted(SUPPORTED_QTYPES))})"
        )
