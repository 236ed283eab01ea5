"""Gemma 4's dense block in the fused native stack (kernels/cpu/src/layer.c through kernels.cpu.decoder): the plan.

Beside Gemma 3's pieces (Q/K norms, sandwich norms, GELU, sliding layers with their own RoPE tables) a Gemma 4
layer has its own head size, K/V heads and MLP width, a weightless V norm, attention scale 1, V = K in the 31B's
global layers, and, in the E models,
KV-shared layers (q alone, reading an earlier layer's pool slot) and a per-layer input after the MLP; any layer may
scale the residual stream at its end. The per-op path (models.archs.gemma4) calls the same kernels in the same order, so
the two agree bit for bit.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.cpu.blocks import Decoder, Layer, Norms
from edgeserve.kernels.cpu.decoder import FLOATS, NativeDecoder, fits, qweight
from edgeserve.kernels.cpu.native import BlockWeight, kept_f32_ptr


def _layers_fit(model) -> bool:
    """Whether every layer's weights and sizes are ones layer.c takes (no experts; a KV-shared layer's
    heads shaped as its source's; sliding heads D_local wide, global ones as wide as the global RoPE table)."""
    c = model.config
    w, h = c.per_layer_input_size, c.hidden_size
    global_dim, local_dim = model.cos.shape[1] * 2, model.cos_local.shape[1] * 2
    for i, layer in enumerate(model.layers):
        d, kv = layer.head_dim, layer.kv_heads
        f = layer.gate_up.shape[0] // 2 if isinstance(layer.gate_up, BlockWeight) else 0
        src = model.layers[c.kv_source(i)]
        if layer.moe is not None or d % 2 or d != (global_dim if layer.window is None else local_dim):
            return False
        if layer.shared and (src.head_dim, src.kv_heads, src.window is None) != (d, kv, layer.window is None):
            return False
        qkv = c.num_heads * d + (0 if layer.shared else (1 if layer.k_eq_v else 2) * kv * d)
        shapes = [(layer.qkv, (qkv, h)), (layer.o_proj, (h, c.num_heads * d)), (layer.gate_up, (2 * f, h)),
                  (layer.down, (h, f))]
        if w:
            shapes += [(layer.ple_gate, (w, h)), (layer.ple_proj, (h, w))]
        if not f or not all(fits(m, s) for m, s in shapes):
            return False
    return True


def build_gemma4(model) -> NativeDecoder | None:
    """The fused plan for a Gemma4Model (models.archs.gemma4), or None where it does not fit the native stack (weights
    not in block formats, the 26B-A4B's experts, float32 compute, a GPU, the kernels off)."""
    c = model.config
    lib = cpu_native.library()
    if lib is None or model.device.type != "cpu" or model.dtype not in FLOATS:
        return None
    w = c.per_layer_input_size
    if not model.layers or (w and (w % 32 or w > c.hidden_size)) or not _layers_fit(model):
        return None
    keep: list[torch.Tensor] = []
    ptr = functools.partial(kept_f32_ptr, keep)

    layers = model.layers
    array = (Layer * len(layers))()
    for i, layer in enumerate(layers):
        nxt = layers[i + 1].input_norm if i + 1 < len(layers) else model.norm
        sliding = layer.window is not None
        out = array[i]
        a = out.attn
        a.qkv, a.o = qweight(layer.qkv), qweight(layer.o_proj)
        a.q_norm, a.k_norm, a.v_norm = ptr(layer.q_norm), ptr(layer.k_norm), ptr(model._v_norm[layer.head_dim])
        a.D, a.Hkv, a.window, a.local_rope = layer.head_dim, layer.kv_heads, layer.window or 0, int(sliding)
        a.kv_shared, a.k_eq_v = int(layer.shared), int(layer.k_eq_v)
        out.mlp.gate_up, out.mlp.down, out.mlp.F = qweight(layer.gate_up), qweight(layer.down), \
            layer.gate_up.shape[0] // 2
        if w:
            out.ple.gate, out.ple.proj, out.ple.norm = qweight(layer.ple_gate), qweight(layer.ple_proj), \
                ptr(layer.ple_norm)
        out.norms = Norms(ptr(layer.post_attn_norm), ptr(layer.pre_ffn_norm), ptr(layer.post_ffn_norm), ptr(nxt),
                          0.0 if layer.scale == 1.0 else layer.scale)
    first = layers[0]
    decoder = Decoder(len(layers), c.hidden_size, c.num_heads, first.kv_heads, model.cos.shape[1] * 2,
                      first.gate_up.shape[0] // 2, c.rms_norm_eps, 1.0, model.act_dtype == torch.bfloat16, True,
                      ptr(first.input_norm), ctypes.cast(array, ctypes.POINTER(Layer)), ptr(model.cos), ptr(model.sin),
                      ptr(model.cos_local), ptr(model.sin_local), model.cos_local.shape[1], w)
    windows = [layer.window for layer in layers if layer.window is not None]
    return NativeDecoder(lib, decoder, array, keep, c.hidden_size, model.act_dtype, windowed=bool(windows),
                         min_window=min(windows, default=0))
