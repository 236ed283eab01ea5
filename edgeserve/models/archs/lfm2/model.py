"""The LFM2 decoder over flat token batches (LlamaModel's interface).

Each layer is x = x + mixer(operator_norm(x)); x = x + ffn(ffn_norm(x)); the final norm is `embedding_norm`. The
mixer is either
  - a gated short convolution (kernels.dispatch.gated_short_conv): in_proj gives [b | c | x], y = c * conv(b * x)
    with a causal depthwise conv of kernel K continuing from the sequence's conv state (a slot of the engine's
    StatePool, `attn.states`), then out_proj; it keeps no KV, or
  - GQA attention with per-head Q/K RMSNorm and RoPE over the paged KV pool, then out_proj.
The feed-forward is a SwiGLU MLP (w1 gate, w3 up, w2 down), or (LFM2-MoE, after its leading dense layers) routed
experts: the router's sigmoids, plus a per-expert bias, choose the top k; the chosen sigmoids, renormalized, weigh
them (edgeserve.models.moe's layer, its "sigmoid_bias" router: moe_layer.c's ROUTE_SIGMOID_BIAS on the CPU). LFM2,
LFM2.5 and LFM2-MoE steps run the whole stack as one native call where its plan fits
(models.archs.lfm2.native_plan: the same kernels in the same order; LFM3's in archs.lfm3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgeserve.errors import ModelLoadError
from edgeserve.kernels.cpu.decoder import NativeDecoder
from edgeserve.kernels.dispatch import (add_rms_norm, gated_short_conv, linear, rms_norm,
                                        rope_write_kv)
from edgeserve.kernels.formats.quant_linear import LinearWeight, PromptRows
from edgeserve.kernels.torch.rope import rope_inv_freq
from edgeserve.loaders.weights import WeightSource
from edgeserve.models.attention import KVAttention
from edgeserve.models.config import ModelConfig
from edgeserve.models.decoder_scaffold import LoadedDecoder, next_norm, step_states
from edgeserve.models.llama import set_rotary_decoder_fields
from edgeserve.models.moe import MoEConfig, MoELayer, ffn_input_dtype
from edgeserve.models.moe_weights import load_moe_layer
from edgeserve.models.text_part import RenamedWeights, text_part
from edgeserve.models.weight_loader import WeightLoader

# HF per-expert projection names of LFM2-MoE, by the names edgeserve.models.moe_weights reads
_EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


class Lfm2MoeWeights(RenamedWeights):
    """An HF LFM2-MoE checkpoint's `feed_forward.*` expert tensors under the `mlp.*` names the shared MoE loader
    reads (`mlp.gate.weight`, `mlp.experts.{j}.gate_proj.weight`, ...); other names as they are."""

    def _name(self, name: str) -> str:
        head, sep, tail = name.partition(".mlp.")
        if not sep:
            return name
        parts = tail.split(".")
        if len(parts) == 4 and parts[0] == "experts":  # experts.{j}.{proj}.weight
            parts[2] = _EXPERT_NAMES.get(parts[2], parts[2])
        return f"{head}.feed_forward." + ".".join(parts)

    def blocks(self, name: str):
        """GGUF block bytes (an HF source has none)."""
        return None


@dataclass
class Lfm2Layer:
    """One block's weights: a short convolution (`in_proj` [3C, C], `conv` [C, K], `out_proj`) or attention (`qkv`
    stacked, per-head Q/K norms, `o_proj`), and the SwiGLU feed-forward (gate and up stacked)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    gate_up: LinearWeight | None
    down: LinearWeight | None
    moe: MoELayer | None = None  # LFM2-MoE: the routed experts (their choice bias inside)
    # attention
    qkv: LinearWeight | None = None
    qkv_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    o_proj: LinearWeight | None = None
    # short convolution
    conv_index: int = -1  # its index among the conv layers (its layer of the state pool)
    in_proj: LinearWeight | None = None
    conv: torch.Tensor | None = None
    out_proj: LinearWeight | None = None
    # sandwich norms (LFM3): on the mixer's and the feed-forward's outputs
    post_mixer_norm: torch.Tensor | None = None
    post_ffn_norm: torch.Tensor | None = None


class Lfm2Model(LoadedDecoder):
    """LFM2 over the engine's paged KV pool with the step's conv states beside it (`attn.states`)."""

    layers: list[Lfm2Layer]  # type: ignore[assignment]

    @classmethod
    def weight_view(cls, config: ModelConfig, source: WeightSource) -> WeightSource:
        """The text model's names (an HF checkpoint's, LFM2-MoE's experts under the shared MoE loader's names, or
        an lfm2 GGUF file's)."""
        src = text_part(source)
        return Lfm2MoeWeights(src) if config.is_moe and getattr(source, "gguf", None) is None else src

    NAME = "LFM2"  # in the step's error messages
    LAYER: type[Lfm2Layer] = Lfm2Layer

    @classmethod
    def load(cls, config: ModelConfig, w: WeightLoader) -> "Lfm2Model":
        """Build the model from its tensors (short-conv and attention layers)."""
        c, norm = config, w.tensor
        layers, conv_index = [], 0
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            layer = cls.LAYER(input_norm=norm(p + "operator_norm.weight"), post_norm=norm(p + "ffn_norm.weight"),
                              **cls._feed_forward(c, w.source, i, w.matrix, norm, w.device, w.dtype),
                              **cls._extra_norms(w, p))
            if c.is_linear(i):
                layer.conv_index, conv_index = conv_index, conv_index + 1
                layer.in_proj = w.matrix([p + "conv.in_proj.weight"])
                layer.out_proj = w.matrix([p + "conv.out_proj.weight"])
                layer.conv = cls._conv_weight(c, norm(p + "conv.conv.weight"), i)
            else:
                cls._attention_weights(c, w, layer, i)
            layers.append(layer)
        embed, lm_head = w.embed_and_head("model.embed_tokens.weight", c.tie_word_embeddings)
        return cls(c, embed, layers, norm("model.embedding_norm.weight"), lm_head, cls._inv_freq(c, w), w.dtype,
                   w.device)

    @classmethod
    def _extra_norms(cls, w: WeightLoader, prefix: str) -> dict:
        """Norm fields of a layer beyond LFM2's two (none)."""
        return {}

    @staticmethod
    def _attention_weights(c: ModelConfig, w: WeightLoader, layer: Lfm2Layer, i: int) -> None:
        """Layer i's attention: q, k, v stacked, Q/K norms, out_proj."""
        a = f"model.layers.{i}.self_attn."
        layer.qkv = w.matrix([a + f"{x}_proj.weight" for x in "qkv"])
        layer.q_norm, layer.k_norm = w.tensor(a + "q_layernorm.weight"), w.tensor(a + "k_layernorm.weight")
        layer.o_proj = w.matrix([a + "out_proj.weight"])

    @staticmethod
    def _inv_freq(c: ModelConfig, w: WeightLoader) -> torch.Tensor:
        """The RoPE inverse frequencies of the attention layers."""
        return rope_inv_freq(c.head_dim, c.rope_theta, None, None)

    @staticmethod
    def _feed_forward(c: ModelConfig, src, i: int, matrix, norm, dev: torch.device, dtype: torch.dtype) -> dict:
        """Layer i's feed-forward fields: routed experts where the layer has a router (LFM2-MoE past its leading
        dense layers), else the SwiGLU MLP."""
        p = f"model.layers.{i}."
        if c.is_moe and src.has(p + "mlp.gate.weight"):
            bias = p + "feed_forward.expert_bias"
            return dict(gate_up=None, down=None, moe=load_moe_layer(
                c, src, i, matrix, dev, dtype, lfm2_moe_config(c), norm(bias) if src.has(bias) else None))
        f = p + "feed_forward."
        return dict(gate_up=matrix([f + "w1.weight", f + "w3.weight"]), down=matrix([f + "w2.weight"]))

    @staticmethod
    def _conv_weight(c: ModelConfig, conv: torch.Tensor, i: int) -> torch.Tensor:
        """A conv layer's depthwise weight as [C, K] (HF stores [C, 1, K], a GGUF [C, K]), checked against the
        state the config declares."""
        conv = conv.reshape(conv.shape[0], -1)
        k_minus_1, channels = c.layer_state.tensors[0].shape
        if tuple(conv.shape) != (channels, k_minus_1 + 1):
            raise ModelLoadError(f"layer {i}: short-conv weight has shape {tuple(conv.shape)}, expected "
                                 f"{(channels, k_minus_1 + 1)}")
        return conv

    def __init__(self, config: ModelConfig, embed, layers: list[Lfm2Layer], norm: torch.Tensor,
                 lm_head: LinearWeight, inv_freq: torch.Tensor, dtype: torch.dtype, device: torch.device):
        set_rotary_decoder_fields(self, config, embed, layers, norm, lm_head, inv_freq, dtype, device)

    def native_plan(self) -> NativeDecoder | None:
        """The fused plan (models.archs.lfm2.native_plan); None where it does not apply."""
        from edgeserve.models.archs.lfm2.native_plan import build_lfm2

        return build_lfm2(self)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: KVAttention,
                prompt_rows: PromptRows | None = None) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] for a flat batch of T tokens, over the engine's paged KV pool
        (`attn` exposing `layer_cache` / `attend`) and its conv states (`attn.states`)."""
        states = step_states(attn, positions, self.max_positions, self.NAME, "conv")
        eps, dtype = self.config.rms_norm_eps, self.dtype
        x = self.embed_rows(input_ids)
        native = self.native_decoder()
        if native is not None and native.runs(attn) and native.recurrent.takes(states, x.shape[0]):  # type: ignore
            return native.forward(x, positions, attn)
        ropes = self._ropes(positions)
        h = rms_norm(x, self.layers[0].input_norm, eps).to(dtype)
        for i, layer in enumerate(self.layers):
            if layer.conv is not None:
                (conv_state,) = states.layer(layer.conv_index)
                y = gated_short_conv(linear(h, layer.in_proj, None, prompt_rows),  # type: ignore[arg-type]
                                     layer.conv, conv_state, states.batch)
                y = linear(self.matmul_input(y), layer.out_proj, None, prompt_rows)  # type: ignore[arg-type]
            else:
                y = self._attention(i, layer, h, attn, ropes, prompt_rows)
            if layer.post_mixer_norm is not None:
                y = rms_norm(y, layer.post_mixer_norm, eps)
            h, x = add_rms_norm(y, x, layer.post_norm, eps, ffn_input_dtype(layer, dtype))
            y = self.mlp(layer, h, prompt_rows)  # type: ignore[arg-type]
            if layer.post_ffn_norm is not None:
                y = rms_norm(y, layer.post_ffn_norm, eps)
            h, x = add_rms_norm(y, x, next_norm(self, i), eps, dtype)
        return h

    def _ropes(self, positions: torch.Tensor) -> dict:
        """The step's (cos, sin) by the attention layers' kind: None for LFM2's one kind."""
        return {None: (self.cos[positions], self.sin[positions])}

    def _attention(self, i: int, layer: Lfm2Layer, h: torch.Tensor, attn, ropes: dict,
                   prompt_rows: PromptRows | None) -> torch.Tensor:
        """Attention layer i's output [T, hidden] for its normed input h."""
        q, k, v = self.project_qkv(layer, h, prompt_rows)  # type: ignore[arg-type]
        k_cache, v_cache, slots = attn.layer_cache(i)
        q = rope_write_kv(q, k, v, *ropes[None], k_cache, v_cache, slots)
        return linear(attn.attend(i, q), layer.o_proj, None, prompt_rows)  # type: ignore[arg-type]

    def mlp(self, layer: Lfm2Layer, h: torch.Tensor, prompt_rows: PromptRows | None,  # type: ignore[override]
            lora=None, index: int = 0) -> torch.Tensor:
        """The feed-forward of `layer` for its normed input h [T, hidden]: the SwiGLU MLP, or the routed experts."""
        if layer.moe is None:
            return super().mlp(layer, h, prompt_rows)  # type: ignore[arg-type]
        return layer.moe.forward(h)


def lfm2_moe_config(c: ModelConfig) -> MoEConfig:
    """LFM2-MoE's expert layers: the sigmoid router choosing by sigmoid + expert bias, the chosen sigmoids
    renormalized over their sum + 1e-6 (transformers' Lfm2MoeTopKRouter), SwiGLU experts."""
    return MoEConfig(c.num_experts, c.experts_per_token, c.moe_intermediate_size, "sigmoid_bias",
                     c.norm_topk_prob, norm_eps=1e-6)


def model_class(config: ModelConfig) -> type[Lfm2Model]:
    """LFM2's and LFM2-MoE's decoder (its native plan: models.archs.lfm2.native_plan)."""
    return Lfm2Model


def conv_shapes(config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """The HF names and shapes of a short-conv layer's tensors (`prefix`: the layer's `model.layers.{i}.`)."""
    h, kernel = config.hidden_size, config.layer_state.tensors[0].shape[0] + 1
    return {prefix + "conv.in_proj.weight": (3 * h, h), prefix + "conv.conv.weight": (h, 1, kernel),
            prefix + "conv.out_proj.weight": (h, h)}


def dummy_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF names and shapes of an LFM2 model's tensors, for random weights (edgeserve.models.dummy): short-conv
    and attention layers, the SwiGLU MLP, or (LFM2-MoE) experts on every layer (the leading dense layers' count is
    not in the config) in transformers' fused layout."""
    c, h = config, config.hidden_size
    from edgeserve.models.dummy import attention_shapes, top_shapes

    shapes = top_shapes(c, norm="model.embedding_norm.weight")
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        f = p + "feed_forward."
        shapes.update({p + "operator_norm.weight": (h,), p + "ffn_norm.weight": (h,)})
        if c.is_moe:
            e, m = c.num_experts, c.moe_intermediate_size
            shapes.update({f + "gate.weight": (e, h), f + "expert_bias": (e,),
                           f + "experts.gate_up_proj": (e, 2 * m, h), f + "experts.down_proj": (e, h, m)})
        else:
            w = c.intermediate_size
            shapes.update({f + "w1.weight": (w, h), f + "w3.weight": (w, h), f + "w2.weight": (h, w)})
        if c.is_linear(i):
            shapes.update(conv_shapes(c, p))
        else:
            a = p + "self_attn."
            shapes.update(attention_shapes(c, a, out="out_proj"))
            shapes.update({a + "q_layernorm.weight": (c.head_dim,), a + "k_layernorm.weight": (c.head_dim,)})
    return shapes
