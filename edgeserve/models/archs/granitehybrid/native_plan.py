"""Granite 4 H (dense) in the fused native stack (kernels/cpu/src/layer.c through kernels.cpu.decoder): the plan.

Each layer is the Mamba-2 mixer block (archs.nemotron_h.native_plan: in_proj, conv + SiLU, the SSD recurrence over
the step's states in place, the gated group RMSNorm, out_proj) or the attention block, then the gated (SwiGLU) MLP
block; Granite's residual multiplier is the layers' branch scale (norms_t.branch_scale), its attention multiplier
the decoder's scale. Granite's attention has no positional encoding: the plan's RoPE tables are one identity row
(cos 1, sin 0) and the model runs the stack with every row at position 0 (RoPE is the only reader of positions in
layer.c; the attention's causal span comes from each row's length). The embedding multiplier and the logit scaling
stay outside the stack, as on the per-op path.

A layer with routed experts enters as its moe_layer.c plan where the MoE layer runs the MLP as its shared expert (a
GGUF's); a checkpoint whose MLP runs beside the experts stays per-op (the stack runs one feed-forward a layer).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.cpu.blocks import Decoder, Layer
from edgeserve.kernels.cpu.decoder import FLOATS, NativeDecoder, fits, qweight
from edgeserve.kernels.cpu.decoder_moe import moe_plans
from edgeserve.kernels.cpu.native import kept_f32_ptr
from edgeserve.models.archs.nemotron_h.config import mamba2_dims
from edgeserve.models.archs.nemotron_h.native_plan import (identity_rope, mamba2_fits, mamba2_mixers, pack_mamba2,
                                                            recurrent)

log = logging.getLogger(__name__)


def _layers_fit(model, moe: list) -> bool:
    """Whether every layer's weights are ones layer.c takes, of the config's shapes, with one feed-forward each."""
    c, dims = model.config, mamba2_dims(model.config)
    h, qd, kvd = c.hidden_size, c.num_heads * c.head_dim, c.kv_size
    for layer, plan in zip(model.layers, moe):
        if plan is not None and layer.gate_up is not None:
            log.info("Granite 4 H stays per-op: its MLP runs beside the routed experts (the stack runs one "
                     "feed-forward a layer)")
            return False
        if plan is None:
            f = layer.down.shape[1] if layer.down is not None else 0
            if not f or not (fits(layer.gate_up, (2 * f, h)) and fits(layer.down, (h, f))):
                return False
        if layer.mamba is not None:
            if not mamba2_fits(dims, layer.mamba, h):
                return False
        elif not (fits(layer.qkv, (qd + 2 * kvd, h)) and fits(layer.o_proj, (h, qd))):
            return False
    return True


def build_granite(model) -> NativeDecoder | None:
    """The fused plan for a GraniteHybridModel, or None where it does not fit the native stack (weights or experts
    not in block formats, an MLP beside the experts, a GPU, the kernels off)."""
    c = model.config
    lib = cpu_native.library()
    if lib is None or model.device.type != "cpu" or model.dtype not in FLOATS or not model.layers or c.head_dim % 2:
        return None
    moe = moe_plans(model)
    if moe is None or not _layers_fit(model, moe):
        return None
    keep: list[torch.Tensor] = []
    ptr = functools.partial(kept_f32_ptr, keep)
    dims, layers = mamba2_dims(c), model.layers
    array, mixers = (Layer * len(layers))(), mamba2_mixers(c.num_linear_layers)
    for i, layer in enumerate(layers):
        out = array[i]
        if layer.mamba is not None:
            pack_mamba2(out, mixers, layer.state_index, dims, layer.mamba, c.rms_norm_eps, ptr)
        else:
            out.attn.qkv, out.attn.o = qweight(layer.qkv), qweight(layer.o_proj)
        if moe[i] is not None:
            out.moe = moe[i].address()
        else:
            out.mlp.gate_up, out.mlp.down = qweight(layer.gate_up), qweight(layer.down)
            out.mlp.F = layer.down.shape[1]
        out.norms.ffn_in = ptr(layer.post_norm)
        out.norms.next = ptr(layers[i + 1].input_norm if i + 1 < len(layers) else model.norm)
        out.norms.branch_scale = c.residual_scale if c.residual_scale != 1.0 else 0.0
    identity = identity_rope(c.head_dim)  # no positional encoding
    f = next((layer.down.shape[1] for layer, plan in zip(layers, moe) if plan is None), 0)
    scale = c.query_scale or c.head_dim ** -0.5
    decoder = Decoder(len(layers), c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, f, c.rms_norm_eps, scale,
                      model.dtype == torch.bfloat16, False, ptr(layers[0].input_norm),
                      ctypes.cast(array, ctypes.POINTER(Layer)), ptr(identity[0]), ptr(identity[1]))
    return NativeDecoder(lib, decoder, array, keep, c.hidden_size, model.dtype,
                         recurrent=recurrent(mixers, c.num_linear_layers), moe=[p for p in moe if p is not None])
