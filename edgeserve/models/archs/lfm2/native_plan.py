"""LFM2 / LFM2.5 / LFM2-MoE (and LFM3 through build_conv_hybrid) in the fused native stack (kernels/cpu/src/layer.c through kernels.cpu.decoder): the plan.

A short-conv layer is the mixer block with its gated short convolution (conv_layer.h): layer.c runs the in_proj
matmul ([B | C | x] per row), then `qmm_conv_mix` (kernels/cpu/src/short_conv.c: C * conv(B * x), the causal
depthwise conv continuing from each sequence's conv state, read and written in place in the engine's state pool),
then out_proj. An attention layer is the attention block with per-head Q/K RMSNorm and RoPE; a layer's
feed-forward is the gated (SiLU) MLP or, LFM2-MoE's past its leading dense layers, the MoE block (layer_t.moe:
moe_layer.c with its ROUTE_SIGMOID_BIAS router, the struct the per-op MoELayer runs too). The per-op path
(models.archs.lfm2.model through kernels.dispatch) calls the same kernels in the same order, so the two agree bit
for bit.

`build_conv_hybrid` is the plan of the whole family: LFM3's (models.archs.lfm3.native_plan) passes its attention
layers' options (sliding windows, local RoPE, the per-head gate) and its sandwich norms ride on the layers' fields;
LFM2-MoE's experts are the MoE block (above).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.cpu.blocks import Attention, ConvLayer, Decoder, Layer, Norms
from edgeserve.kernels.cpu.decoder import FLOATS, NativeDecoder, fits, qweight
from edgeserve.kernels.cpu.decoder_moe import moe_plans
from edgeserve.kernels.cpu.native import GDN_MAX_CONV_KERNEL, BlockWeight, kept_f32_ptr
from edgeserve.kernels.cpu.recurrent_step import RecurrentStep

# an attention layer's options beyond LFM2's (the Attention struct, the model's layer) and its qkv rows beyond q, k, v
AttentionOptions = Callable[[Attention, object], None]
ExtraRows = Callable[[object], int]


def _layers_fit(model, moe: list, extra_rows: ExtraRows) -> bool:
    """Whether every layer's weights are ones layer.c takes, of the config's shapes (`moe`: each layer's MoE plan,
    None for a dense MLP; an attention layer's qkv with `extra_rows(layer)` rows after q, k, v)."""
    c = model.config
    h, qd, kvd = c.hidden_size, c.num_heads * c.head_dim, c.kv_size
    for layer, plan in zip(model.layers, moe):
        f = layer.gate_up.shape[0] // 2 if isinstance(layer.gate_up, BlockWeight) else 0
        if not f and plan is None:
            return False
        shapes = [(layer.gate_up, (2 * f, h)), (layer.down, (h, f))] if plan is None else []
        if layer.conv is not None:
            shapes += [(layer.in_proj, (3 * h, h)), (layer.out_proj, (h, h))]
        else:
            shapes += [(layer.qkv, (qd + 2 * kvd + extra_rows(layer), h)), (layer.o_proj, (h, qd))]
        if not all(fits(w, s) for w, s in shapes):
            return False
    return True


def build_lfm2(model) -> NativeDecoder | None:
    """The fused plan for an Lfm2Model (models.archs.lfm2.model: LFM2 / LFM2.5), or None where it does not fit the
    native stack (weights not in block formats, experts moe_layer.c does not take, a conv wider than the kernels
    take, a GPU, the kernels off)."""
    return build_conv_hybrid(model)


def build_conv_hybrid(model, options: AttentionOptions | None = None, extra_rows: ExtraRows = lambda layer: 0,
                      local: tuple[torch.Tensor, torch.Tensor] | None = None) -> NativeDecoder | None:
    """The fused plan of a short-conv hybrid (an Lfm2Model or a subclass): conv mixer blocks, attention blocks with
    per-head Q/K norms (and `options` on each, its qkv `extra_rows` longer), the SwiGLU MLP or the MoE block, and the
    sandwich norms where the layers have them; `local`: the local_rope layers' RoPE tables (cos, sin). None where it
    does not fit."""
    c = model.config
    lib = cpu_native.library()
    if lib is None or model.device.type != "cpu" or model.dtype not in FLOATS or not model.layers:
        return None
    convs = [layer for layer in model.layers if layer.conv is not None]
    moe = moe_plans(model)  # each layer's MoE block (None: the dense MLP)
    if c.head_dim % 2 or any(layer.conv.shape[1] > GDN_MAX_CONV_KERNEL for layer in convs) or moe is None \
            or not _layers_fit(model, moe, extra_rows):
        return None
    keep: list[torch.Tensor] = []
    ptr = functools.partial(kept_f32_ptr, keep)
    array, mixers = _plan_layers(model, ptr, options, moe)
    cos_local, sin_local = local or (None, None)
    decoder = Decoder(len(model.layers), c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                      next((out.mlp.F for out in array if out.mlp.F), 0),
                      c.rms_norm_eps, c.head_dim ** -0.5,
                      model.dtype == torch.bfloat16, False, ptr(model.layers[0].input_norm),
                      ctypes.cast(array, ctypes.POINTER(Layer)), ptr(model.cos), ptr(model.sin), ptr(cos_local),
                      ptr(sin_local))
    windows = [array[i].attn.window for i in range(len(array)) if array[i].attn.window]
    return NativeDecoder(lib, decoder, array, keep, c.hidden_size, model.dtype, windowed=bool(windows),
                         min_window=min(windows, default=0),
                         recurrent=RecurrentStep(mixers, len(convs), ("conv",)),
                         moe=[p for p in moe if p is not None])


def _plan_layers(model, ptr, options: AttentionOptions | None, moe: list) -> tuple[ctypes.Array, ctypes.Array]:
    """The layers' structs and the conv layers' ConvLayer structs (the mixer blocks point into them); `moe`: each
    layer's MoE plan (None: its dense MLP)."""
    layers = model.layers
    array = (Layer * len(layers))()
    mixers = (ConvLayer * max(1, sum(layer.conv is not None for layer in layers)))()
    for i, layer in enumerate(layers):
        out = array[i]
        if moe[i] is not None:
            out.moe = moe[i].address()
        else:
            out.mlp.gate_up, out.mlp.down = qweight(layer.gate_up), qweight(layer.down)
            out.mlp.F = layer.gate_up.shape[0] // 2
        out.norms = Norms(ptr(layer.post_mixer_norm), ptr(layer.post_norm), ptr(layer.post_ffn_norm),
                          ptr(layers[i + 1].input_norm if i + 1 < len(layers) else model.norm))
        if layer.conv is not None:
            j = layer.conv_index
            mixers[j] = ConvLayer(layer.conv.shape[0], layer.conv.shape[1], j, ptr(layer.conv))
            out.mixer.in_proj, out.mixer.out_proj = qweight(layer.in_proj), qweight(layer.out_proj)
            out.mixer.conv = ctypes.addressof(mixers[j])
        else:
            out.attn.qkv, out.attn.o = qweight(layer.qkv), qweight(layer.o_proj)
            out.attn.qkv_bias, out.attn.q_norm, out.attn.k_norm = ptr(layer.qkv_bias), ptr(layer.q_norm), \
                ptr(layer.k_norm)
            if options is not None:
                options(out.attn, layer)
    return array, mixers
