"""What the group-quantized weight layouts share: every tensor field indexed by output row first (codes, then the
per-group scales and offsets), so reordering rows, stacking weights along the output dimension, moving devices
and counting bytes are the same for each (Q4Blocks, Q8Blocks, W4A16Weight, W8A16Weight)."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import ClassVar, TypeVar

import torch

T = TypeVar("T", bound="RowTensors")


class RowTensors:
    """A dataclass whose fields are tensors with the output rows first, plus an int `group_size`."""

    group_size: int

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor fields by name, in declaration order."""
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}  # type: ignore[arg-type]

    def rows(self: T, index: torch.Tensor) -> T:
        """The same weight with its output rows reordered by `index`."""
        return replace(self, **{name: t[index] for name, t in self.tensors().items()})  # type: ignore[type-var]

    @classmethod
    def stack(cls, parts: list[T]) -> T:
        """Weights of one group size stacked along the output dimension (for fused QKV and gate/up)."""
        return replace(parts[0], **{name: torch.cat([p.tensors()[name] for p in parts])  # type: ignore[type-var]
                                    for name in parts[0].tensors()})

    @property
    def nbytes(self) -> int:
        """Bytes one matmul reads from the weight (all of its tensors)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def to(self: T, device: torch.device | str) -> T:
        """The same weight on another device."""
        return replace(self, **{name: t.to(device) for name, t in self.tensors().items()})  # type: ignore[type-var]


class GroupBlocks(RowTensors):
    """Codes `q` [out, in] with their per-group tensors: the form weights load in (Q4Blocks, Q8Blocks)."""

    q: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    @classmethod
    def cat(cls: type[T], parts: list[T]) -> T:
        """Stack weights along the output dimension (for fused QKV and gate/up)."""
        return cls.stack(parts)


class PackedWeight(RowTensors):
    """A layout for the W*A16 kernels: `qweight` [N, K // VALUES_PER_ELEMENT] with the per-group tensors beside it."""

    VALUES_PER_ELEMENT: ClassVar[int] = 1
    qweight: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * self.VALUES_PER_ELEMENT

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError


def dequantized_matmul(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x's dtype (the torch twin of the W*A16 kernels: dequantize, then one float32
    matmul)."""
    y = x.reshape(-1, x.shape[-1]).float() @ weight.dequantize().t()
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.out_features)
