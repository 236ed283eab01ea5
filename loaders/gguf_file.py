"""Open a GGUF file over mmap: metadata as Python values, tensors on demand."""

from __future__ import annotations

import mmap
import os
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from edgeserve.errors import ModelLoadError, UnsupportedModelError

from .gguf_parse import GGUFTensorInfo, parse_gguf

__all__ = ["GGUFFile", "GGUFTensorInfo", "check_supported_qtype"]

# Types whose raw data is typed values; every other type is raw block bytes (as gguf.GGUFReader gives them).
_VALUE_DTYPES = {"F32": "f4", "F16": "f2", "F64": "f8", "I8": "i1", "I16": "i2", "I32": "i4", "I64": "i8"}


class GGUFFile:
    """A GGUF file opened read-only over mmap; nothing is copied until a tensor is asked for."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        if not self.path.exists():
            raise ModelLoadError(f"model file not found: {self.path}")
        if not self.path.is_file():
            raise ModelLoadError(f"model path is not a file: {self.path}")
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                # mmap refuses an empty file; the parser reports that one itself.
                self._map: bytes | mmap.mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        except OSError as e:
            raise ModelLoadError(f"cannot read model file {self.path}: {e.strerror or e}") from None
        layout = parse_gguf(self._map, str(self.path))
        self._byte_order = layout.byte_order
        self._tensors = layout.tensors
        self.metadata: dict[str, Any] = {key: _python(value) for key, value in layout.metadata.items()}

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
        return np.frombuffer(self._map, dtype, prod(shape), info.data_offset).reshape(shape)

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
