"""Qwen3.5's dense hybrid block in the fused native stack (kernels/cpu/src/layer.c through kernels.cpu.decoder): the plan.

Three of every four layers are Gated DeltaNet (the mixer block): layer.c runs the in_proj matmul, then
`qmm_gdn_mix` (kernels/cpu/src/gated_delta.c: the causal conv + SiLU, the gates, the gated delta rule and the gated
RMSNorm over each sequence's conv and recurrent states, read and written in place in the engine's state pool), then
out_proj. The others are the attention block with its gate option: [q | gate] per head from one projection, Q/K
RMSNorm per head, RoPE (partial RoPE is a row permutation made at load, models.qwen35), paged attention, the output times
sigmoid(gate). Every norm's 1 + w is folded into its weight at load. The per-op path (models.qwen35 through
kernels.dispatch) calls the same kernels in the same order, so the two agree bit for bit.

`qwen35moe`'s feed-forwards are Mixture-of-Experts layers (routed experts plus the sigmoid-gated shared expert): each
enters the stack as its moe_layer.c plan (layer_t.moe, kernels.cpu.decoder_moe.moe_plans), the same struct its per-op
MoELayer runs, and the NativeDecoder keeps the plans alive.
"""

from __future__ import annotations

import ctypes
import functools
from types import SimpleNamespace

import torch

from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.cpu.blocks import Decoder, GdnLayer, Layer
from edgeserve.kernels.cpu.decoder import FLOATS, NativeDecoder, fits, qweight
from edgeserve.kernels.cpu.decoder_moe import moe_plans
from edgeserve.kernels.cpu.recurrent_step import RecurrentStep
from edgeserve.kernels.cpu.native import GDN_MAX_CONV_KERNEL, GDN_MAX_HEAD_DIM, BlockWeight, kept_f32_ptr


def _layers_fit(model, moe: list) -> bool:
    """Whether every layer's weights are ones layer.c takes, of the config's shapes (`moe`: each layer's MoE plan,
    None for a dense feed-forward, whose gated MLP is checked here)."""
    c, d = model.config, model.config.delta
    h, qd, kvd = c.hidden_size, c.num_heads * c.head_dim, c.kv_size
    for layer, plan in zip(model.layers, moe):
        shapes = []
        if plan is None:
            f = layer.gate_up.shape[0] // 2 if isinstance(layer.gate_up, BlockWeight) else 0
            if not f:
                return False
            shapes = [(layer.gate_up, (2 * f, h)), (layer.down, (h, f))]
        if layer.delta is not None:
            shapes += [(layer.in_proj, (d.conv_dim + d.value_dim + 2 * d.num_v_heads, h)),
                       (layer.out_proj, (h, d.value_dim))]
        else:
            shapes += [(layer.qkv, (2 * qd + 2 * kvd, h)), (layer.o_proj, (h, qd))]
        if not all(fits(w, s) for w, s in shapes):
            return False
    return True


def build_qwen35(model) -> NativeDecoder | None:
    """The fused plan for a Qwen35Model (models.qwen35: dense `qwen35` or MoE `qwen35moe`), or None where it does not
    fit the native stack (weights or experts not in block formats, head sizes the kernels do not take, a GPU, the
    kernels off)."""
    c = model.config
    lib = cpu_native.library()
    if (lib is None or model.device.type != "cpu" or model.dtype not in FLOATS
            or not model.layers or c.delta is None):
        return None
    d = c.delta
    if max(d.head_k_dim, d.head_v_dim, c.head_dim) > GDN_MAX_HEAD_DIM or d.conv_kernel > GDN_MAX_CONV_KERNEL \
            or c.head_dim % 2:
        return None
    moe = moe_plans(model)  # each layer's MoE feed-forward in moe_layer.c (None: a gated MLP)
    if moe is None or not _layers_fit(model, moe):
        return None
    keep: list[torch.Tensor] = []
    ptr = functools.partial(kept_f32_ptr, keep)
    layers = model.layers
    array = (Layer * len(layers))()
    mixers = (GdnLayer * max(1, c.num_linear_layers))()
    for i, layer in enumerate(layers):
        out = array[i]
        _pack_feed_forward(out, layer, moe[i], ptr)
        out.norms.next = ptr(layers[i + 1].input_norm if i + 1 < len(layers) else model.norm)
        if layer.delta is not None:
            w, j = layer.delta, layer.linear_index
            mixers[j] = GdnLayer(d.num_k_heads, d.num_v_heads, d.head_k_dim, d.head_v_dim, d.conv_kernel,
                                 int(d.tiled), j, w.norm_eps, d.head_k_dim ** -0.5, ptr(w.conv_weight),
                                 ptr(w.A_log), ptr(w.dt_bias), ptr(w.norm_weight))
            out.mixer.in_proj, out.mixer.out_proj = qweight(layer.in_proj), qweight(layer.out_proj)
            out.mixer.gdn = ctypes.addressof(mixers[j])
        else:
            _pack_attention(out, layer, ptr)
    f = next((layer.gate_up.shape[0] // 2 for layer, plan in zip(layers, moe) if plan is None), 0)
    decoder = Decoder(len(layers), c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, f, c.rms_norm_eps,
                      c.head_dim ** -0.5, model.act_dtype == torch.bfloat16, False, ptr(layers[0].input_norm),
                      ctypes.cast(array, ctypes.POINTER(Layer)), ptr(model.cos), ptr(model.sin))
    return NativeDecoder(lib, decoder, array, keep, c.hidden_size, model.act_dtype,
                         recurrent=RecurrentStep(mixers, c.num_linear_layers, replays=True), moe=[p for p in moe if p is not None])


def _pack_attention(out: Layer, layer, ptr) -> None:
    """A gated full-attention layer's weights into layer_t `out` (`ptr`: kept_f32_ptr over the plan's keep list)."""
    a = out.attn
    a.qkv, a.o = qweight(layer.qkv), qweight(layer.o_proj)
    a.q_norm, a.k_norm, a.gate = ptr(layer.q_norm), ptr(layer.k_norm), 1


def _pack_feed_forward(out: Layer, layer, plan, ptr) -> None:
    """A layer's feed-forward (its moe_layer.c plan, or the gated MLP where `plan` is None) and post-mixer norm into
    layer_t `out`."""
    if plan is not None:
        out.moe = plan.address()
    else:
        out.mlp.gate_up, out.mlp.down = qweight(layer.gate_up), qweight(layer.down)
    out.norms.ffn_in = ptr(layer.post_norm)


def build_mtp_head(model, head) -> NativeDecoder | None:
    """The MTP head's block (models.mtp_head.MtpHead: gated full attention + feed-forward, one decoder layer) as a
    one-layer fused plan over the head's own one-layer K/V pool: `forward(x, positions, attn)` takes the block's input
    x (the eh_proj output, float32) and gives shared_head_norm of its output, g, as models.mtp_head.mtp_forward's
    per-op path computes it (the same kernels in the same order). None where the trunk itself does not run fused, or
    the block's weights do not fit the stack."""
    trunk = model.native_decoder()
    if trunk is None:
        return None
    c, layer = model.config, head.layer
    one = SimpleNamespace(layers=[layer], config=c)
    moe = moe_plans(one)
    if moe is None:
        return None
    shapes = [(layer.qkv, (2 * c.num_heads * c.head_dim + 2 * c.kv_size, c.hidden_size)),
              (layer.o_proj, (c.hidden_size, c.num_heads * c.head_dim))]
    f = layer.gate_up.shape[0] // 2 if moe[0] is None and isinstance(layer.gate_up, BlockWeight) else 0
    if moe[0] is None:
        shapes += [(layer.gate_up, (2 * f, c.hidden_size)), (layer.down, (c.hidden_size, f))]
    if (moe[0] is None and not f) or not all(fits(w, s) for w, s in shapes):
        return None
    keep: list[torch.Tensor] = []
    ptr = functools.partial(kept_f32_ptr, keep)
    array = (Layer * 1)()
    _pack_attention(array[0], layer, ptr)
    _pack_feed_forward(array[0], layer, moe[0], ptr)
    array[0].norms.next = ptr(head.head_norm)
    decoder = Decoder(1, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, f, c.rms_norm_eps,
                      c.head_dim ** -0.5, model.act_dtype == torch.bfloat16, False, ptr(layer.input_norm),
                      ctypes.cast(array, ctypes.POINTER(Layer)), ptr(model.cos), ptr(model.sin))
    return NativeDecoder(trunk.lib, decoder, array, keep, c.hidden_size, model.act_dtype,
                         moe=[p for p in moe if p is not None])
