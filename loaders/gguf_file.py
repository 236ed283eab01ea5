"""Open a GGUF file over mmap: metadata as Python values, tensors on demand."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgeserve.errors import ModelLoadError, UnsupportedModelError

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file and how it is stored."""

    name: str
    shape: tuple[int, ...]  # torch order: (rows, cols) for a matrix
    qtype: str  # ggml type name: F32, F16, Q4_1, ...
    n_bytes: int


class GGUFFile:
    """A GGUF file opened read-only over mmap; nothing is copied until a tensor is asked for."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"model file not found: {self.path}")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise ModelLoadError(f"{self.path} is not a GGUF file (magic {magic!r}, expected b'GGUF')")
        try:
            from gguf import GGUFReader

            self._reader = GGUFReader(self.path, "r")
        except Exception as e:  # the gguf package raises assorted errors on damaged files
            raise ModelLoadError(f"{self.path} is truncated or corrupt: {type(e).__name__}: {e}") from None
        self.metadata: dict[str, Any] = {}
        for key, field in self._reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                self.metadata[key] = field.contents()
            except Exception as e:
                raise ModelLoadError(f"{self.path}: cannot read metadata key {key!r}: {e}") from None
        self._tensors = {t.name: t for t in self._reader.tensors}
        for t in self._reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise ModelLoadError(
                    f"{self.path} is truncated: tensor {t.name!r} ends at byte {t.data_offset + t.n_bytes}, "
                    f"file has {size} bytes"
                )

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
        """Shape (torch order), storage type and size of one tensor."""
        t = self._get(name)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        return GGUFTensorInfo(name, shape, t.tensor_type.name, int(t.n_bytes))

    def raw(self, name: str) -> np.ndarray:
        """The tensor's stored bytes/values as a read-only view into the mmap (no copy)."""
        return self._get(name).data

    def load_tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One tensor dequantized to `dtype`, in torch order; only this tensor's bytes are read."""
        from .dequant import dequantize

        info = self.tensor_info(name)
        values = dequantize(self.raw(name), info.qtype, info.shape)
        return values.to(dtype)

    def _get(self, name: str):
        try:
            return self._tensors[name]
        except KeyError:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing") from None


def check_supported_qtype(qtype: str, name: str) -> None:
    """Refuse by name a tensor whose storage type we cannot dequantize."""
    from .dequant import SUPPORTED_QTYPES

    if qtype not in SUPPORTED_QTYPES:
        raise UnsupportedModelError(
            f"tensor {name!r} uses quantization type {qtype}, which edgeserve does not support "
            f"(supported: {', '.join(sorted(SUPPORTED_QTYPES))})"
        )
