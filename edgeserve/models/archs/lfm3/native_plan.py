"""LFM3 in the fused native stack (kernels/cpu/src/layer.c through kernels.cpu.decoder): the plan.

LFM2's plan (models.archs.lfm2.native_plan.build_conv_hybrid: gated short-conv mixer blocks, attention with per-head
Q/K norms, the SwiGLU MLP) with LFM3's attention options: a sliding layer attends over its window (`window`) with
RoPE from the local tables (base 10,000, every frequency pair), a global one over every position with the main tables
(proportional partial RoPE: the tail pairs' frequencies are 0, so they do not turn), and each head's output is scaled
by the sigmoid of its one gate value (`head_gate`: the gate's rows stacked after q, k, v in qkv). The sandwich norms
are the layers' `post_mixer_norm` / `post_ffn_norm` (norms_t.mix_out / ffn_out). The per-op path
(models.archs.lfm3.model) calls the same kernels in the same order, so the two agree bit for bit.
"""

from __future__ import annotations

from edgeserve.kernels.cpu.blocks import Attention
from edgeserve.kernels.cpu.decoder import NativeDecoder
from edgeserve.models.archs.lfm2.native_plan import build_conv_hybrid


def _attention_options(a: Attention, layer) -> None:
    """An LFM3 attention layer's options: its window and local RoPE (sliding layers), its per-head gate."""
    a.window = layer.window or 0
    a.local_rope = int(layer.window is not None)
    a.head_gate = int(layer.gated)


def build_lfm3(model) -> NativeDecoder | None:
    """The fused plan for an Lfm3Model (models.archs.lfm3.model), or None where it does not fit the native stack
    (weights not in block formats, a GPU, the kernels off)."""
    heads = model.config.num_heads
    return build_conv_hybrid(model, _attention_options, lambda layer: heads if layer.gated else 0,
                             (model.cos_local, model.sin_local))
