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
    """The step's distinct adapters (slot = index), each row's scale, and the rows of each slot (index tensors for
    the torch path; for the native one, `seg_rows` holds them slot after slot, slot a's from `seg_start[a]`)."""

    adapters: list[LoraAdapter]
    row_scale: torch.Tensor  # float32 [T] (0 for a row with no adapter)
    segments: list[torch.Tensor]  # per slot: its rows, int64
    seg_start: torch.Tensor  # int32 [slots + 1], on the host
    seg_rows: torch.Tensor  # int32 [rows with an adapter], on the host

    @classmethod
    def build(cls, per_seq: list[tuple[LoraAdapter, float] | None], query_lens: list[int],
              device: torch.device | str = "cpu") -> "StepLora | None":
        """The step of sequences with these adapters (None: the base) and query lengths; None when no row runs an
        adapter."""
        if all(a is None for a in per_seq):
            return None
        adapters: list[LoraAdapter] = []
        slot_of: dict[int, int] = {}
        slots, scales = [], []
        for sel, n in zip(per_seq, query_lens):
            if sel is None:
                slots += [-1] * n
                scales += [0.0] * n
                continue
            adapter, scale = sel
            slot = slot_of.setdefault(id(adapter), len(adapters))
            if slot == len(adapters):
                adapters.append(adapter)
            slots += [slot] * n
            scales += [float(scale)] * n
        row_slot = torch.tensor(slots, dtype=torch.int32)
        rows = [torch.nonzero(row_slot == s).flatten() for s in range(len(adapters))]
        start = torch.tensor([0, *itertools.accumulate(len(r) for r in rows)], dtype=torch.int32)
        return cls(adapters, torch.tensor(scales, dtype=torch.float32, device=device), [r.to(device) for r in rows],
                   start, torch.cat(rows).to(torch.int32))

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, target: str) -> torch.Tensor:
        """out [T, N] (the base matmul's output of x [T, K]) plus each row's s * (x A^T) B^T, in float32."""
        x = x.reshape(x.shape[0], -1)
        for adapter, rows in zip(self.adapters, self.segments):
            pair = adapter.layers[layer].get(target)
            if pair is None or not rows.numel():
                continue
            t = (x[rows].float() @ pair.a.float().t()) * self.row_scale[rows, None]
            for part in pair.parts:
                r, n = part.bt.shape
                cols = out[:, part.c0:part.c0 + n]
                cols.index_add_(0, rows, (t[:, part.r0:part.r0 + r] @ part.bt.float()).to(out.dtype))
        return out
