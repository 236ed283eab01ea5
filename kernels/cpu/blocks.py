"""The fused layer stack's C structs (kernels/cpu/include/layer.h, gdn_layer.h, conv_layer.h, ssd_layer.h,
moe_layer.h) in ctypes: one definition each.

A layer is blocks, each switched on by its struct's fields (zero / NULL: off): the attention block with its options
(`Attention`), or a recurrent mixer in its place (`Mixer`: a Gated DeltaNet, a gated short convolution or a Mamba-2
mixer), the gated MLP (`Mlp`) or a Mixture-of-Experts feed-forward in its place (`Layer.moe`: a `MoE` of `Experts`,
packed by kernels.cpu.moe_layer), a per-layer input (`Ple`) and the residual stream's norms (`Norms`). A model's plan
fills them (kernels.cpu.decoder for the Llama-like models, each architecture's native_plan.py for the others).
`qmm_decoder_layout` gives C's sizes and offsets, which
tests/kernels/test_cpu_decoder_layout.py holds these to (`C_NAMES`).
"""

from __future__ import annotations

import ctypes

MAX_PARTS = 4  # layer.h's QWEIGHT_MAX_PARTS: the stacked parts of one weight
EXPERT_PARTS = 4  # moe_layer.h's EXPERT_PARTS: the stacked parts of one expert projection
_i32, _i64, _f32, _p = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class QWeight(ctypes.Structure):
    """qweight_t: a BlockWeight's parts (format id, rows, bytes per row, data pointer); no parts: no weight."""

    _fields_ = [("n_parts", _i32), ("fmt", _i32 * MAX_PARTS), ("rows", _i32 * MAX_PARTS),
                ("row_bytes", _i64 * MAX_PARTS), ("w", _p * MAX_PARTS)]


class Attention(ctypes.Structure):
    """attention_t: the attention block and its options (layer.h says what each does)."""

    _fields_ = [("qkv", QWeight), ("o", QWeight), ("qkv_bias", _p), ("q_norm", _p), ("k_norm", _p), ("v_norm", _p),
                ("sinks", _p), ("o_bias", _p), ("D", _i32), ("Hkv", _i32), ("window", _i32), ("local_rope", _i32),
                ("kv_shared", _i32), ("k_eq_v", _i32), ("gate", _i32), ("head_gate", _i32)]


class Mixer(ctypes.Structure):
    """mixer_t: a recurrent mixer in place of the attention, with its projections: a Gated DeltaNet (a GdnLayer's
    address in `gdn`), a gated short convolution (a ConvLayer's in `conv`) or a Mamba-2 mixer (an SsdLayer's in
    `ssd`)."""

    _fields_ = [("gdn", _p), ("in_proj", QWeight), ("out_proj", QWeight), ("conv", _p), ("ssd", _p)]


class Mlp(ctypes.Structure):
    """mlp_t: the gated MLP block, or with relu2 the ungated squared-ReLU one; F 0: the decoder's intermediate size."""

    _fields_ = [("gate_up", QWeight), ("down", QWeight), ("F", _i32), ("relu2", _i32)]


class Ple(ctypes.Structure):
    """ple_t: a per-layer input after the feed-forward's residual add (no gate parts: none)."""

    _fields_ = [("gate", QWeight), ("proj", QWeight), ("norm", _p)]


class Norms(ctypes.Structure):
    """norms_t: the residual stream's norms around the blocks, its scale at the layer's end and the blocks' outputs'
    scale before their residual adds (0: none)."""

    _fields_ = [("mix_out", _p), ("ffn_in", _p), ("ffn_out", _p), ("next", _p), ("out_scale", _f32),
                ("branch_scale", _f32)]


class Layer(ctypes.Structure):
    """layer_t: the blocks of one layer."""

    _fields_ = [("attn", Attention), ("mixer", Mixer), ("mlp", Mlp), ("moe", _p), ("ple", Ple), ("norms", Norms)]


class Decoder(ctypes.Structure):
    """decoder_t: the model's sizes, its RoPE tables and its layers."""

    _fields_ = [("n_layers", _i32), ("hidden", _i32), ("H", _i32), ("Hkv", _i32), ("D", _i32), ("F", _i32),
                ("eps", _f32), ("scale", _f32), ("act_bf16", _i32), ("gelu", _i32), ("first_norm", _p),
                ("layers", ctypes.POINTER(Layer)), ("cos", _p), ("sin", _p), ("cos_local", _p), ("sin_local", _p),
                ("half_local", _i32), ("ple_width", _i32)]


class StepPools(ctypes.Structure):
    """step_pools_t: one step's K/V pools (main, second), block tables and slots, adapters, per-layer inputs and
    recurrent states."""

    _fields_ = [("k", _p * 2), ("v", _p * 2), ("layer_stride", _i64 * 2), ("tables", _p * 2),
                ("table_stride", _i64 * 2), ("slots", _p * 2), ("layer_pool", _p), ("lora", _p), ("ple", _p),
                ("recurrent", _p)]


class GdnLayer(ctypes.Structure):
    """gdn_layer_t: one Gated DeltaNet mixer's sizes and small weights (Mixer.gdn points to one)."""

    _fields_ = [("Hk", _i32), ("Hv", _i32), ("Dk", _i32), ("Dv", _i32), ("K", _i32), ("tiled", _i32),
                ("index", _i32), ("eps", _f32), ("scale", _f32), ("conv_weight", _p), ("A_log", _p),
                ("dt_bias", _p), ("norm", _p)]


class GdnStep(ctypes.Structure):
    """gdn_step_t: one step's recurrent-state pools and ragged batch (StepPools.recurrent)."""

    _fields_ = [("conv", _p), ("conv_slot_stride", _i64), ("conv_layer_stride", _i64), ("state", _p),
                ("state_slot_stride", _i64), ("state_layer_stride", _i64), ("cu", _p), ("slots", _p), ("B", _i32),
                ("keep", _p), ("spec", _p), ("spec_layer_stride", _i64), ("spec_rows", _i32), ("owed", _p),
                ("owed_layer_stride", _p), ("owed_n", _p)]


class Experts(ctypes.Structure):
    """experts_t: one projection of every expert, up to EXPERT_PARTS parts stacked along the output rows; expert
    e's rows of part p at w[p] + e * expert_bytes[p]."""

    _fields_ = [("n_parts", _i32), ("fmt", _i32 * EXPERT_PARTS), ("rows", _i32 * EXPERT_PARTS),
                ("row_bytes", _i64 * EXPERT_PARTS), ("expert_bytes", _i64 * EXPERT_PARTS), ("w", _p * EXPERT_PARTS)]


class MoE(ctypes.Structure):
    """moe_t: a Mixture-of-Experts feed-forward's plan (router, routing, experts, optional shared expert);
    Layer.moe points to one."""

    _fields_ = [("n_experts", _i32), ("k", _i32), ("hidden", _i32), ("F", _i32), ("route", _i32),
                ("normalize", _i32), ("act", _i32), ("alpha", _f32), ("limit", _f32), ("router", _p),
                ("router_bias", _p), ("gate_up", Experts), ("down", Experts), ("gate_up_bias", _p),
                ("down_bias", _p), ("shared_F", _i32), ("shared_gate_up", Experts), ("shared_down", Experts),
                ("shared_gate", _p), ("choice_bias", _p), ("scale", _f32), ("norm_eps", _f32)]


class SsdLayer(ctypes.Structure):
    """ssd_layer_t: one Mamba-2 mixer's sizes and small weights (Mixer.ssd points to one)."""

    _fields_ = [("H", _i32), ("P", _i32), ("N", _i32), ("G", _i32), ("K", _i32), ("index", _i32), ("eps", _f32),
                ("conv_weight", _p), ("conv_bias", _p), ("dt_bias", _p), ("A", _p), ("D", _p), ("norm", _p)]


class ConvLayer(ctypes.Structure):
    """conv_layer_t: one gated short convolution's sizes, its index among the conv layers and its [C, K] weight
    (Mixer.conv points to one); it runs over the step's GdnStep (its conv fields)."""

    _fields_ = [("C", _i32), ("K", _i32), ("index", _i32), ("weight", _p)]


# each struct's C name (qmm_decoder_layout's)
C_NAMES = {QWeight: "qweight_t", Attention: "attention_t", Mixer: "mixer_t", Mlp: "mlp_t", Ple: "ple_t",
           Norms: "norms_t", Layer: "layer_t", Decoder: "decoder_t", StepPools: "step_pools_t",
           GdnLayer: "gdn_layer_t", GdnStep: "gdn_step_t", ConvLayer: "conv_layer_t", SsdLayer: "ssd_layer_t",
           Experts: "experts_t", MoE: "moe_t"}


def layout_mismatches(lib: ctypes.CDLL) -> list[str]:
    """`name: C value != ctypes value` for every size and field offset where the library's structs and these
    disagree (empty when they are one layout)."""
    out = []
    for cls, name in C_NAMES.items():
        pairs = [(name, ctypes.sizeof(cls))]
        pairs += [(f"{name}.{field}", getattr(cls, field).offset) for field, _ in cls._fields_]
        out += [f"{key}: {lib.qmm_decoder_layout(key.encode())} != {value}" for key, value in pairs
                if lib.qmm_decoder_layout(key.encode()) != value]
    return out
