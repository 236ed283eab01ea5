"""One step's adapters: which rows run which LoRA adapter at which scale, applied beside the base matmuls.

Rows are grouped by adapter (segments), so a step mixing several adapters and rows with none costs one pair of small
matmuls per adapter and weight, never a per-row or per-request loop, and the base weights are never touched (a
quantized base stays in its blocks: the update applies to the activations)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .lora import LoraAdapter


@dataclass
class StepLora:
    """The step's distinct adapters (slot = index), each row's slot (-1: the base alone) and scale, and the rows
    of each slot (index tensors, for the torch path)."""

    adapters: list[LoraAdapter]
    row_slot: torch.Tensor  # int32 [T]
    row_scale: torch.Tensor  # float32 [T]
    segments: list[torch.Tensor]  # per slot: its rows, int64

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
        segments = [torch.nonzero(row_slot == s).flatten().to(device) for s in range(len(adapters))]
        return cls(adapters, row_slot.to(device), torch.tensor(scales, dtype=torch.float32, device=device), segments)

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, target: str) -> torch.Tensor:
        """out [T, N] (the base matmul's output of x [T, K]) plus each row's s * (x A^T) B^T, in float32."""
        x = x.reshape(x.shape[0], -1)
        for adapter, rows in zip(self.adapters, self.segments):
            pair = adapter.layers[layer].get(target)
            if pair is None or not rows.numel():
                continue
            at, bt = pair.at.to(x.device), pair.bt.to(x.device)
            delta = (x[rows].float() @ at) @ bt * self.row_scale[rows, None]
            out.index_add_(0, rows, delta.to(out.dtype))
        return out
