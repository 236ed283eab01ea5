"""A step's LoRA adapters as kernels/cpu/lora.c's structs, for the fused native decoder stack (cpu_decoder)."""

from __future__ import annotations

import ctypes

import torch

TARGETS = ("qkv", "o_proj", "gate_up", "down")  # lora.c's order of a layer's four fused weights
MAX_PARTS = 3  # lora.c's LORA_MAX_PARTS
_I3 = ctypes.c_int32 * MAX_PARTS


class LoraWeight(ctypes.Structure):
    """lora.c's lora_weight_t: one fused weight's A [r, K] and each stacked part's B^T (a NULL: no update)."""

    _fields_ = [("a", ctypes.c_void_p), ("r", ctypes.c_int32), ("n_parts", ctypes.c_int32), ("part_r0", _I3),
                ("part_r", _I3), ("part_c0", _I3), ("part_n", _I3), ("b", ctypes.c_void_p * MAX_PARTS)]


class LoraStepStruct(ctypes.Structure):
    """lora.c's lora_step_t."""

    _fields_ = [("n_adapters", ctypes.c_int32), ("w_bf16", ctypes.c_int32), ("row_scale", ctypes.c_void_p),
                ("tables", ctypes.c_void_p), ("seg_start", ctypes.c_void_p), ("seg_rows", ctypes.c_void_p)]


def adapter_table(adapter) -> ctypes.Array:
    """The adapter's [layers * 4] lora_weight_t table (built once and kept on the adapter, whose tensors it
    points into; `LoraAdapter.to` drops it)."""
    if adapter.native is None:
        table = (LoraWeight * (4 * len(adapter.layers)))()
        for i, layer in enumerate(adapter.layers):
            for j, name in enumerate(TARGETS):
                pair = layer.get(name)
                if pair is None:
                    continue
                w = table[4 * i + j]
                w.a, w.r, w.n_parts = pair.a.data_ptr(), pair.a.shape[0], len(pair.parts)
                for k, part in enumerate(pair.parts):
                    w.part_r0[k], w.part_c0[k] = part.r0, part.c0
                    w.part_r[k], w.part_n[k] = part.bt.shape
                    w.b[k] = part.bt.data_ptr()
        adapter.native = table
    return adapter.native


def takes(step) -> bool:
    """Whether lora.c runs this step's adapters: all float32 or all bfloat16, on the host (a fused weight has at
    most MAX_PARTS parts by construction: q/k/v)."""
    dtypes = {a.dtype for a in step.adapters}
    return len(dtypes) == 1 and dtypes <= {torch.float32, torch.bfloat16} and all(
        a.device.type == "cpu" for a in step.adapters)


def step_struct(step) -> tuple[LoraStepStruct, list]:
    """The lora_step_t of a models.lora_step.StepLora, and what must stay alive while the native call runs."""
    tables = (ctypes.c_void_p * len(step.adapters))(*[ctypes.addressof(adapter_table(a)) for a in step.adapters])
    bf16 = step.adapters[0].dtype == torch.bfloat16
    scales = step.row_scale.contiguous()
    s = LoraStepStruct(len(step.adapters), int(bf16), scales.data_ptr(), ctypes.addressof(tables),
                       step.seg_start.data_ptr(), step.seg_rows.data_ptr())
    return s, [tables, scales, step.seg_start, step.seg_rows]
