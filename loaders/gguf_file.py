"""Open a GGUF file over mmap: metadata as Python values, tensors on demand."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from edgeserve.errors import ModelLoadError, UnsupportedModelError

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
_HEADER_SIZE = 24  # magic, u32 version, u64 tensor count, u64 metadata key count
# Smallest possible encodings, used to reject counts that cannot fit in the file before parsing.
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, 1-byte value (empty key)
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset (empty name, no dims)


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
        if not self.path.exists():
            raise ModelLoadError(f"model file not found: {self.path}")
        if not self.path.is_file():
            raise ModelLoadError(f"model path is not a file: {self.path}")
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                header = f.read(_HEADER_SIZE)
        except OSError as e:
            raise ModelLoadError(f"cannot read model file {self.path}: {e.strerror or e}") from None
        _check_header(self.path, header, size)
        try:
            from gguf import GGUFReader

            self._reader = GGUFReader(self.path, "r")
        except OSError as e:
            raise ModelLoadError(f"cannot read model file {self.path}: {e.strerror or e}") from None
        except Exception as e:  # on damage the gguf reader raises ValueError, IndexError, KeyError, ...
            raise ModelLoadError(
                f"{self.path} is truncated or corrupt ({size} bytes; reader failed with {type(e).__name__}: {e})"
            ) from None
        self.metadata: dict[str, Any] = {}
        for key, field in self._reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                self.metadata[key] = field.contents()
            except Exception as e:
                raise ModelLoadError(f"{self.path} is corrupt: cannot read metadata key {key!r}: {e}") from None
        # The reader keeps a numpy view per array element (~100k for a vocabulary): drop them once read.
        self._reader.fields.clear()
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
        check_supported_qtype(info.qtype, name)
        try:
            values = dequantize(self.raw(name), info.qtype, info.shape)
        except ModelLoadError as e:
            raise ModelLoadError(f"{self.path}: tensor {name!r}: {e}") from None
        return values.to(dtype)

    def _get(self, name: str):
        try:
            return self._tensors[name]
        except KeyError:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing") from None


def _check_header(path: Path, header: bytes, size: int) -> None:
    """Reject files that are not GGUF, or whose fixed header is cut short or impossible, with a clear reason."""
    magic = header[:4]
    if size == 0:
        raise ModelLoadError(f"{path} is empty (0 bytes), not a GGUF file")
    if magic != GGUF_MAGIC:
        if size < 4 and GGUF_MAGIC.startswith(magic):
            raise ModelLoadError(f"{path} is truncated: only {size} bytes, shorter than the GGUF header")
        raise ModelLoadError(f"{path} is not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    if size < _HEADER_SIZE:
        raise ModelLoadError(f"{path} is truncated: only {size} bytes, shorter than the {_HEADER_SIZE}-byte GGUF header")
    version = int.from_bytes(header[4:8], "little")
    order: Literal["little", "big"] = "little"
    if version & 0xFFFF == 0:  # written on a big-endian machine
        order = "big"
        version = int.from_bytes(header[4:8], "big")
    if version not in GGUF_VERSIONS:
        raise ModelLoadError(
            f"{path}: GGUF version {version} is not supported (supported: {', '.join(map(str, GGUF_VERSIONS))})"
        )
    n_tensors = int.from_bytes(header[8:16], order)
    n_kv = int.from_bytes(header[16:24], order)
    if _HEADER_SIZE + n_tensors * _MIN_TENSOR_INFO_BYTES + n_kv * _MIN_KV_BYTES > size:
        raise ModelLoadError(
            f"{path} is truncated or corrupt: its header lists {n_tensors} tensors and {n_kv} metadata keys, "
            f"more than fit in {size} bytes"
        )


def check_supported_qtype(qtype: str, name: str) -> None:
    """Refuse by name a tensor whose storage type we cannot dequantize."""
    from .dequant import SUPPORTED_QTYPES

    if qtype not in SUPPORTED_QTYPES:
        raise UnsupportedModelError(
            f"tensor {name!r} uses quantization type {qtype}, which edgeserve does not support "
            f"(supported: {', '.join(sorted(SUPPORTED_QTYPES))})"
        )
