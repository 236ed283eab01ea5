"""The Mamba-2 hybrids' pieces of the fused native stack (kernels/cpu/src/layer.c through kernels.cpu.decoder): the
Mamba-2 mixer block (kernels/cpu/src/mamba2.c: in_proj matmul -> causal conv + bias + SiLU -> the SSD recurrence
over each sequence's conv and SSM states in place in the engine's state pool -> the gated group RMSNorm with z ->
out_proj matmul), packed from a model's Mamba2Weights, and the checks the plans share. Granite 4 H's plan
(archs.granitehybrid.native_plan) builds on these.

Nemotron-H itself stays per-op: its blocks hold one mixer each (Mamba-2, attention, or a squared-ReLU MLP without a
gate, or routed experts), where a layer_t is a token mixer and a gated feed-forward together; it would need an
ungated squared-ReLU MLP block and layers without a mixer or a feed-forward.
"""

from __future__ import annotations

import ctypes
from typing import Callable

from edgeserve.kernels.cpu.blocks import MAX_PARTS, Layer, SsdLayer
from edgeserve.kernels.cpu.decoder import qweight
from edgeserve.kernels.cpu.native import GDN_MAX_CONV_KERNEL, BlockWeight
from edgeserve.kernels.torch.mamba2 import Mamba2Dims
from edgeserve.models.archs.qwen35.native_plan import Mixers


def fits(weight, shape: tuple[int, int]) -> bool:
    """Whether a weight runs in the stack: GGUF blocks of at most MAX_PARTS parts, of this [out, in] shape."""
    return isinstance(weight, BlockWeight) and len(weight.kernel_parts()) <= MAX_PARTS and weight.shape == shape


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


def recurrent(mixers: ctypes.Array, num_layers: int) -> Mixers:
    """The step states' hook of a plan with these Mamba-2 layers (conv and ssm tensors of the state pool)."""
    return Mixers(mixers, num_layers, state="ssm")
