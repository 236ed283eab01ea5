"""LFM2 / LFM2.5 in the fused native stack (kernels/cpu/src/layer.c through kernels.cpu.decoder): the plan.

A short-conv layer is the mixer block with its gated short convolution (conv_layer.h): layer.c runs the in_proj
matmul ([B | C | x] per row), then `qmm_conv_mix` (kernels/cpu/src/short_conv.c: C * conv(B * x), the causal
depthwise conv continuing from each sequence's conv state, read and written in place in the engine's state pool),
then out_proj. An attention layer is the attention block with per-head Q/K RMSNorm and RoPE; a layer's
feed-forward is the gated (SiLU) MLP or, LFM2-MoE's past its leading dense layers, the MoE block (layer_t.moe:
moe_layer.c with its ROUTE_SIGMOID_BIAS router, the struct the per-op MoELayer runs too). The per-op path (models.archs.lfm2.model through kernels.dispatch) calls the same
kernels in the same order, so the two agree bit for bit.

What stays per-op, and why (said once in the log when the plan is made):
  - LFM3: its attention gate is one sigmoid per head (the attention block's gate option is a head-wide gate
    projected beside each query head).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.cpu.blocks import ConvLayer, Decoder, Layer
from edgeserve.kernels.cpu.decoder import FLOATS, NativeDecoder, fits, qweight
from edgeserve.kernels.cpu.decoder_moe import moe_plans
from edgeserve.kernels.cpu.native import GDN_MAX_CONV_KERNEL, BlockWeight, kept_f32_ptr
from edgeserve.kernels.cpu.recurrent_step import RecurrentStep

log = logging.getLogger(__name__)


def _per_op_reason(model) -> str | None:
    """Why the model's layers stay on the per-op path whatever their weights (None: the plan may take them)."""
    layers = model.layers
    if any(getattr(layer, "gated", False) or getattr(layer, "window", None) for layer in layers) \
            or hasattr(model, "cos_local"):
        return "LFM3's per-head scalar attention gate is not the attention block's gate option"
    return None


def _layers_fit(model, moe: list) -> bool:
    """Whether every layer's weights are ones layer.c takes, of the config's shapes (`moe`: each layer's MoE plan,
    None for a dense MLP)."""
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
            shapes += [(layer.qkv, (qd + 2 * kvd, h)), (layer.o_proj, (h, qd))]
        if not all(fits(w, s) for w, s in shapes):
            return False
    return True


def build_lfm2(model) -> NativeDecoder | None:
    """The fused plan for an Lfm2Model (models.archs.lfm2.model: LFM2 / LFM2.5), or None where it does not fit the
    native stack (weights not in block formats, experts moe_layer.c does not take, a conv wider than the kernels
    take, a GPU, the kernels off; LFM3: see the module's note)."""
    c = model.config
    lib = cpu_native.library()
    if lib is None or model.device.type != "cpu" or model.dtype not in FLOATS or not model.layers:
        return None
    reason = _per_op_reason(model)
    if reason is not None:
        log.info("%s stays on the per-op path: %s", c.architecture, reason)
        return None
    convs = [layer for layer in model.layers if layer.conv is not None]
    moe = moe_plans(model)  # each layer's MoE block (None: the dense MLP)
    if c.head_dim % 2 or any(layer.conv.shape[1] > GDN_MAX_CONV_KERNEL for layer in convs) or moe is None \
            or not _layers_fit(model, moe):
        return None
    keep: list[torch.Tensor] = []
    ptr = functools.partial(kept_f32_ptr, keep)
    layers = model.layers
    array = (Layer * len(layers))()
    mixers = (ConvLayer * max(1, len(convs)))()
    for i, layer in enumerate(layers):
        out = array[i]
        if moe[i] is not None:
            out.moe = moe[i].address()
        else:
            out.mlp.gate_up, out.mlp.down = qweight(layer.gate_up), qweight(layer.down)
            out.mlp.F = layer.gate_up.shape[0] // 2
        out.norms.ffn_in = ptr(layer.post_norm)
        out.norms.next = ptr(layers[i + 1].input_norm if i + 1 < len(layers) else model.norm)
        if layer.conv is not None:
            j = layer.conv_index
            mixers[j] = ConvLayer(layer.conv.shape[0], layer.conv.shape[1], j, ptr(layer.conv))
            out.mixer.in_proj, out.mixer.out_proj = qweight(layer.in_proj), qweight(layer.out_proj)
            out.mixer.conv = ctypes.addressof(mixers[j])
        else:
            out.attn.qkv, out.attn.o = qweight(layer.qkv), qweight(layer.o_proj)
            out.attn.qkv_bias, out.attn.q_norm, out.attn.k_norm = ptr(layer.qkv_bias), ptr(layer.q_norm), \
                ptr(layer.k_norm)
    f = next((out.mlp.F for out in array if out.mlp.F), 0)
    decoder = Decoder(len(layers), c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, f,
                      c.rms_norm_eps, c.head_dim ** -0.5,
                      model.dtype == torch.bfloat16, False, ptr(layers[0].input_norm),
                      ctypes.cast(array, ctypes.POINTER(Layer)), ptr(model.cos), ptr(model.sin))
    return NativeDecoder(lib, decoder, array, keep, c.hidden_size, model.dtype,
                         recurrent=RecurrentStep(mixers, len(convs), ("conv",)),
                         moe=[p for p in moe if p is not None])
