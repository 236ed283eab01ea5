"""The fused stack's structs are written once in C (kernels/cpu/include/layer.h, gdn_layer.h, conv_layer.h,
ssd_layer.h, moe_layer.h) and once in ctypes (kernels.cpu.blocks): the library's qmm_decoder_layout gives C's sizes
and field offsets, and every ctypes struct must agree with it field for field."""

from __future__ import annotations

import ctypes

import pytest

from edgeserve.kernels.cpu import blocks
from edgeserve.kernels.cpu import native as cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no native CPU kernels here")


def test_ctypes_structs_have_the_c_layout():
    lib = cpu_native.library()
    assert not blocks.layout_mismatches(lib)
    # every struct and field was asked for by name, and C knew each one
    assert lib.qmm_decoder_layout(b"layer_t.attn") == 0
    assert lib.qmm_decoder_layout(b"layer_t.norms") == blocks.Layer.norms.offset > 0
    assert lib.qmm_decoder_layout(b"mixer_t.ssd") == blocks.Mixer.ssd.offset > blocks.Mixer.out_proj.offset
    assert lib.qmm_decoder_layout(b"ssd_layer_t.norm") == blocks.SsdLayer.norm.offset > 0
    assert lib.qmm_decoder_layout(b"norms_t.branch_scale") == blocks.Norms.branch_scale.offset > 0
    assert lib.qmm_decoder_layout(b"no_such_t") == -1
    # the MoE block's plan too (moe_layer.h): every field of moe_t and experts_t, and both sizes
    for cls in (blocks.MoE, blocks.Experts):
        name = blocks.C_NAMES[cls]
        assert lib.qmm_decoder_layout(name.encode()) == ctypes.sizeof(cls) > 0
        assert all(lib.qmm_decoder_layout(f"{name}.{field}".encode()) == getattr(cls, field).offset
                   for field, _ in cls._fields_)
    assert lib.qmm_decoder_layout(b"moe_t.shared_gate") > lib.qmm_decoder_layout(b"moe_t.gate_up") > 0
    # the gated short-conv mixer: its struct, and its pointer after the projections in mixer_t
    assert lib.qmm_decoder_layout(b"conv_layer_t") == ctypes.sizeof(blocks.ConvLayer) > 0
    assert lib.qmm_decoder_layout(b"mixer_t.conv") == blocks.Mixer.conv.offset > blocks.Mixer.out_proj.offset


def test_the_layout_check_sees_a_field_out_of_place(monkeypatch):
    class Swapped(ctypes.Structure):  # attention_t with two fields in the wrong order
        _fields_ = [(name, kind) for name, kind in blocks.Attention._fields_ if name != "o"] + \
            [("o", blocks.QWeight)]

    monkeypatch.setattr(blocks, "C_NAMES", {Swapped: "attention_t"})
    found = blocks.layout_mismatches(cpu_native.library())
    assert any(line.startswith("attention_t.o:") for line in found)
    assert any(line.startswith("attention_t.qkv_bias:") for line in found)


def test_the_layout_check_sees_a_moe_field_out_of_place(monkeypatch):
    class Swapped(ctypes.Structure):  # moe_t with its router pointers in the wrong order
        _fields_ = [(name, kind) for name, kind in blocks.MoE._fields_ if name != "router"]
        _fields_.insert(_fields_.index(("router_bias", ctypes.c_void_p)) + 1, ("router", ctypes.c_void_p))

    monkeypatch.setattr(blocks, "C_NAMES", {Swapped: "moe_t", blocks.Experts: "experts_t"})
    found = blocks.layout_mismatches(cpu_native.library())
    assert sorted(line.split(":")[0] for line in found) == ["moe_t.router", "moe_t.router_bias"]
