"""Nemotron-H (dense) in the fused native stack (kernels/cpu/src/layer.c through kernels.cpu.decoder): the plan, and
the Mamba-2 pieces the hybrids' plans share (Granite 4 H's, archs.granitehybrid.native_plan, builds on them).

The Mamba-2 mixer block (kernels/cpu/src/mamba2.c): in_proj matmul -> causal conv + bias + SiLU -> the SSD
recurrence over each sequence's conv and SSM states in place in the engine's state pool -> the gated group RMSNorm
with z -> out_proj matmul, packed from a model's Mamba2Weights.

Each Nemotron-H block, x = x + mixer(norm(x)), is one layer_t with one block on: a Mamba-2 or attention layer without
a feed-forward (its output added, then the next block's norm), or an MLP layer without a token mixer (the ungated
squared-ReLU MLP, mlp_t.relu2, on the input the previous layer normed), or a MoE layer without a token mixer
(nemotron_h_moe: layer_t.moe, moe_layer.c with its ROUTE_SIGMOID_BIAS router, ungated ACT_RELU2 experts and the
ungated shared expert: the struct the per-op MoELayer runs too). The attention has no positional encoding: the RoPE
tables are one identity row and the model runs the stack with every row at position 0.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import Callable

import torch

from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.cpu.blocks import Decoder, Layer, SsdLayer
from edgeserve.kernels.cpu.decoder import FLOATS, NativeDecoder, fits, qweight
from edgeserve.kernels.cpu.decoder_moe import moe_plans
from edgeserve.kernels.cpu.native import GDN_MAX_CONV_KERNEL, kept_f32_ptr
from edgeserve.kernels.torch.mamba2 import Mamba2Dims
from edgeserve.kernels.cpu.recurrent_step import RecurrentStep

log = logging.getLogger(__name__)


def mamba2_fits(dims: Mamba2Dims, weights, hidden: int) -> bool:
    """Whether a Mamba-2 mixer's projections and conv fit the block (block-format weights of its shapes, a conv the
    conv kernel takes, the gated norm over whole groups)."""
    return (dims.conv_kernel <= GDN_MAX_CONV_KERNEL and dims.inner % dims.n_groups == 0
            and fits(weights.in_proj, (dims.in_proj_dim, hidden)) and fits(weights.out_proj, (hidden, dims.inner)))


def mamba2_mixers(count: int) -> ctypes.Array:
    """An array of `count` ssd_layer_t structs (at least one) for a plan's Mamba-2 layers."""
    return (SsdLayer * max(1, count))()


def pack_mamba2(out: Layer, mixers: ctypes.Array, index: int, dims: Mamba2Dims, weights, eps: float,
                ptr: Callable) -> None:
    """Mamba-2 layer `index` (its layer of the state pool; `weights`: models' Mamba2Weights) into mixers[index] and
    layer_t `out`'s mixer (`ptr`: kept_f32_ptr over the plan's keep list)."""
    d, w = dims, weights
    mixers[index] = SsdLayer(d.num_heads, d.head_dim, d.state_size, d.n_groups, d.conv_kernel, index, eps,
                             ptr(w.conv), ptr(w.conv_bias), ptr(w.dt_bias.reshape(-1)), ptr(w.A.reshape(-1)),
                             ptr(w.D.reshape(-1)), ptr(w.norm))
    out.mixer.in_proj, out.mixer.out_proj = qweight(w.in_proj), qweight(w.out_proj)
    out.mixer.ssd = ctypes.addressof(mixers[index])


def recurrent(mixers: ctypes.Array, num_layers: int) -> RecurrentStep:
    """The step states' hook of a plan with these Mamba-2 layers (conv and ssm tensors of the state pool)."""
    return RecurrentStep(mixers, num_layers, ("conv", "ssm"))


def identity_rope(head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One identity RoPE row (cos 1, sin 0) for attention without positional encoding (rows run at position 0)."""
    return torch.ones(1, head_dim // 2), torch.zeros(1, head_dim // 2)


def _blocks_fit(model, moe: list) -> bool:
    """Whether every Nemotron-H block's weights are ones layer.c takes, of the config's shapes (`moe`: each block's
    MoE plan, None for another kind)."""
    c, dims = model.config, model.dims
    h, qd, kvd = c.hidden_size, c.num_heads * c.head_dim, c.kv_size
    for layer, plan in zip(model.layers, moe):
        if layer.moe is not None:
            ok = plan is not None
        elif layer.mamba is not None:
            ok = mamba2_fits(dims, layer.mamba, h)
        elif layer.qkv is not None:
            ok = fits(layer.qkv, (qd + 2 * kvd, h)) and fits(layer.o_proj, (h, qd))
        else:
            f = layer.down.shape[1] if layer.down is not None else 0
            ok = bool(f) and fits(layer.up, (f, h)) and fits(layer.down, (h, f))
        if not ok:
            return False
    return True


def build_nemotron_h(model) -> NativeDecoder | None:
    """The fused plan for a NemotronHModel (dense or MoE), or None where it does not fit the native stack (weights
    not in block formats, experts moe_layer.c does not take, a GPU, the kernels off)."""
    c = model.config
    lib = cpu_native.library()
    if lib is None or model.device.type != "cpu" or model.dtype not in FLOATS or not model.layers or c.head_dim % 2:
        return None
    moe = moe_plans(model)  # each MoE block's plan (None: another kind)
    if moe is None or not _blocks_fit(model, moe):
        log.info("%s stays on the per-op path: a block's weights do not fit the native stack", c.architecture)
        return None
    keep: list[torch.Tensor] = []
    ptr = functools.partial(kept_f32_ptr, keep)
    layers = model.layers
    array, mixers = (Layer * len(layers))(), mamba2_mixers(c.num_linear_layers)
    f = 0
    for i, layer in enumerate(layers):
        out = array[i]
        if layer.mamba is not None:
            pack_mamba2(out, mixers, layer.state_index, model.dims, layer.mamba, c.rms_norm_eps, ptr)
        elif layer.qkv is not None:
            out.attn.qkv, out.attn.o = qweight(layer.qkv), qweight(layer.o_proj)
        elif moe[i] is not None:
            out.moe = moe[i].address()
        else:
            out.mlp.gate_up, out.mlp.down = qweight(layer.up), qweight(layer.down)
            out.mlp.F, out.mlp.relu2 = layer.down.shape[1], 1
            f = f or layer.down.shape[1]
        out.norms.next = ptr(layers[i + 1].input_norm if i + 1 < len(layers) else model.norm)
    cos, sin = identity_rope(c.head_dim)
    decoder = Decoder(len(layers), c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, f, c.rms_norm_eps,
                      c.query_scale or c.head_dim ** -0.5, model.dtype == torch.bfloat16, False,
                      ptr(layers[0].input_norm), ctypes.cast(array, ctypes.POINTER(Layer)), ptr(cos), ptr(sin))
    return NativeDecoder(lib, decoder, array, keep, c.hidden_size, model.dtype,
                         recurrent=recurrent(mixers, c.num_linear_layers), moe=[p for p in moe if p is not None])
