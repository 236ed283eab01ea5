"""One step's adapters: which rows run which LoRA adapter at which scale, applied beside the base matmuls.

Rows are grouped by adapter (segments), so a step mixing several adapters and rows with none costs one pair of small
matmuls per adapter and weight, never a per-row or per-request loop, and the base weights are never touched (a
quantized base stays in its blocks: the update applies to the activations)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from .lora import LoraAdapter


@dataclass
class StepLora:
    """The step's distinct adapters (slot = index), each row's scale, and the rows of each slot: `seg_rows` holds
    them slot after slot, slot a's from `seg_start[a]` (on the host; the native stack reads them as they are)."""

    adapters: list[LoraAdapter]
    row_scale: torch.Tensor  # float32 [T] (0 for a row with no adapter)
    seg_start: torch.Tensor  # int32 [slots + 1], on the host
    seg_rows: torch.Tensor  # int32 [rows with an adapter], on the host
    device: torch.device | str = "cpu"  # where the torch path indexes rows

    @classmethod
    def build(cls, per_seq: list[tuple[LoraAdapter, float] | None], query_lens: list[int],
              device: torch.device | str = "cpu") -> "StepLora | None":
        """The step of sequences with these adapters (None: the base) and query lengths; None when no row runs an
        adapter."""
        if all(a is None for a in per_seq):
            return None
        adapters: list[LoraAdapter] = []
        slot_of: dict[int, int] = {}
        rows: list[list[int]] = []
        scales: list[float] = []
        for sel, n in zip(per_seq, query_lens):
            if sel is None:
                scales += [0.0] * n
                continue
            adapter, scale = sel
            slot = slot_of.setdefault(id(adapter), len(adapters))
            if slot == len(adapters):
                adapters.append(adapter)
                rows.append([])
            rows[slot] += range(len(scales), len(scales) + n)
            scales += [float(scale)] * n
        start = torch.tensor([0, *itertools.accumulate(len(r) for r in rows)], dtype=torch.int32)
        return cls(adapters, torch.tensor(scales, dtype=torch.float32, device=device), start,
                   torch.tensor([i for r in rows for i in r], dtype=torch.int32), device)

    def segments(self) -> list[torch.Tensor]:
        """Each slot's rows (int64, on the step's device), for the torch path."""
        rows = self.seg_rows.to(self.device, torch.int64)
        return [rows[int(a):int(b)] for a, b in zip(self.seg_start[:-1], self.seg_start[1:])]

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, target: str) -> torch.Tensor:
        """out [T, N] (the base matmul's output of x [T, K]) plus each row's s * (x A^T) B^T, in float32."""
        x = x.reshape(x.shape[0], -1)
        for adapter, rows in zip(self.adapters, self.segments()):
            pair = adapter.layers[layer].get(target)
            if pair is None or not rows.numel():
                continue
            t = (x[rows].float() @ pair.a.float().t()) * self.row_scale[rows, None]
            for part in pair.parts:
                r, n = part.bt.shape
                cols = out[:, part.c0:part.c0 + n]
                cols.index_add_(0, rows, (t[:, part.r0:part.r0 + r] @ part.bt.float()).to(out.dtype))
        return out
