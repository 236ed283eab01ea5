"""A step's LoRA adapters as kernels/cpu/lora.c's structs, for the fused native decoder stack (cpu_decoder)."""

from __future__ import annotations

import ctypes

TARGETS = ("qkv", "o_proj", "gate_up", "down")  # lora.c's order of a layer's four fused weights


class LoraWeight(ctypes.Structure):
    """lora.c's lora_weight_t: one fused weight's at [K, R] and bt [R, N] (NULL: no update there)."""

    _fields_ = [("at", ctypes.c_void_p), ("bt", ctypes.c_void_p), ("r", ctypes.c_int32)]


class LoraStepStruct(ctypes.Structure):
    """lora.c's lora_step_t."""

    _fields_ = [("n_adapters", ctypes.c_int32), ("row_slot", ctypes.c_void_p), ("row_scale", ctypes.c_void_p),
                ("tables", ctypes.c_void_p)]


def adapter_table(adapter) -> ctypes.Array:
    """The adapter's [layers * 4] lora_weight_t table (built once and kept on the adapter, whose tensors it
    points into)."""
    if adapter.native is None:
        table = (LoraWeight * (4 * len(adapter.layers)))()
        for i, layer in enumerate(adapter.layers):
            for j, name in enumerate(TARGETS):
                pair = layer.get(name)
                if pair is not None:
                    table[4 * i + j] = LoraWeight(pair.at.data_ptr(), pair.bt.data_ptr(), pair.at.shape[1])
        adapter.native = table
    return adapter.native


def step_struct(step) -> tuple[LoraStepStruct, list]:
    """The lora_step_t of a models.lora_step.StepLora, and what must stay alive while the native call runs."""
    tables = (ctypes.c_void_p * len(step.adapters))(*[ctypes.addressof(adapter_table(a)) for a in step.adapters])
    slots, scales = step.row_slot.contiguous(), step.row_scale.contiguous()
    s = LoraStepStruct(len(step.adapters), slots.data_ptr(), scales.data_ptr(), ctypes.addressof(tables))
    return s, [tables, slots, scales]
