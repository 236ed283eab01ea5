"""A step's LoRA adapters as kernels/cpu/src/lora.c's structs, for the fused native decoder stack (cpu_decoder).

An adapter's float32 / bfloat16 pairs are read in place; with `LoraAdapter.int8` the stack reads an int8 copy
instead (one float32 scale per rank row of A and of each part's B^T, B^T in panels of PANEL columns), half the bytes
of bfloat16 per step."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

TARGETS = ("qkv", "o_proj", "gate_up", "down")  # lora.c's order of a layer's four fused weights
MAX_PARTS = 3  # lora.c's LORA_MAX_PARTS
PANEL = 64  # columns per panel of an int8 B^T (a multiple of 16: lora.c's vectors)
TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}  # lora.c's LORA_F32 / LORA_BF16 / LORA_I8
_I3 = ctypes.c_int32 * MAX_PARTS
_P3 = ctypes.c_void_p * MAX_PARTS


class LoraWeight(ctypes.Structure):
    """lora.c's lora_weight_t: one fused weight's A [r, K] and each stacked part's B^T (a NULL: no update)."""

    _fields_ = [("a", ctypes.c_void_p), ("a_scale", ctypes.c_void_p), ("r", ctypes.c_int32),
                ("n_parts", ctypes.c_int32), ("type", ctypes.c_int32), ("pad", ctypes.c_int32), ("part_r0", _I3),
                ("part_r", _I3), ("part_c0", _I3), ("part_n", _I3), ("part_pw", _I3), ("b", _P3),
                ("b_scale", _P3)]


class LoraStepStruct(ctypes.Structure):
    """lora.c's lora_step_t."""

    _fields_ = [("n_adapters", ctypes.c_int32), ("pad", ctypes.c_int32), ("row_scale", ctypes.c_void_p),
                ("tables", ctypes.c_void_p), ("seg_start", ctypes.c_void_p), ("seg_rows", ctypes.c_void_p)]


@dataclass
class NativeAdapter:
    """An adapter's [layers * 4] lora_weight_t table and the tensors it points into (kept alive with it)."""

    table: ctypes.Array
    tensors: list[torch.Tensor]


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [r, n] as int8 with one float32 scale per row (symmetric, the row's largest magnitude at 127): w ~= q *
    scale[:, None], each value within scale / 2 (a row of zeros stays exactly zero)."""
    w = w.float()
    scale = w.abs().amax(dim=1) / 127.0
    q = torch.round(w / torch.where(scale > 0, scale, 1.0)[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def panels(bt: torch.Tensor, width: int = PANEL) -> torch.Tensor:
    """bt [r, n] as lora.c's panel layout: each `width` columns' [r, width] block contiguous, the last one narrower."""
    r, n = bt.shape
    full = n // width * width
    head = bt[:, :full].reshape(r, n // width, width).transpose(0, 1).reshape(-1)
    return torch.cat([head, bt[:, full:].reshape(-1)]).contiguous()


def adapter_table(adapter) -> ctypes.Array:
    """The adapter's [layers * 4] lora_weight_t table (built once and kept on the adapter, whose tensors it points
    into; `LoraAdapter.to` drops it)."""
    if adapter.native is None:
        table = (LoraWeight * (4 * len(adapter.layers)))()
        keep: list[torch.Tensor] = []
        for i, layer in enumerate(adapter.layers):
            for j, name in enumerate(TARGETS):
                pair = layer.get(name)
                if pair is not None:
                    _fill(table[4 * i + j], pair, adapter.int8, keep)
        adapter.native = NativeAdapter(table, keep)
    return adapter.native.table


def _fill(w: LoraWeight, pair, int8: bool, keep: list[torch.Tensor]) -> None:
    """One lora_weight_t of a fused weight's pair: in place, or as an int8 copy (appended to `keep`)."""
    w.r, w.n_parts = pair.a.shape[0], len(pair.parts)
    if int8:
        a, a_scale = quantize_rows(pair.a)
        keep += [a, a_scale]
        w.a, w.a_scale, w.type = a.data_ptr(), a_scale.data_ptr(), TYPES[torch.int8]
    else:
        w.a, w.type = pair.a.data_ptr(), TYPES[pair.a.dtype]
    for k, part in enumerate(pair.parts):
        w.part_r0[k], w.part_c0[k] = part.r0, part.c0
        w.part_r[k], w.part_n[k] = part.bt.shape
        if int8:
            q, scale = quantize_rows(part.bt)
            b = panels(q)
            keep += [b, scale]
            w.b[k], w.b_scale[k], w.part_pw[k] = b.data_ptr(), scale.data_ptr(), PANEL
        else:
            w.b[k], w.part_pw[k] = part.bt.data_ptr(), part.bt.shape[1]


def takes(step) -> bool:
    """Whether lora.c runs this step's adapters: each float32 or bfloat16, on the host (a fused weight has at most
    MAX_PARTS parts by construction: q/k/v)."""
    return all(a.dtype in (torch.float32, torch.bfloat16) and a.device.type == "cpu" for a in step.adapters)


def step_struct(step) -> tuple[LoraStepStruct, list]:
    """The lora_step_t of a models.lora_step.StepLora, and what must stay alive while the native call runs."""
    tables = (ctypes.c_void_p * len(step.adapters))(*[ctypes.addressof(adapter_table(a)) for a in step.adapters])
    scales = step.row_scale.contiguous()
    s = LoraStepStruct(len(step.adapters), 0, scales.data_ptr(), ctypes.addressof(tables),
                       step.seg_start.data_ptr(), step.seg_rows.data_ptr())
    return s, [tables, scales, step.seg_start, step.seg_rows]
