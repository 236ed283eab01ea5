"""The Granite 4 H decoder (dense) over flat token batches (LlamaModel's interface).

Each layer is x = x + r * mixer(input_norm(x)); x = x + r * mlp(post_norm(x)) with Granite's residual multiplier r,
the embeddings times its embedding multiplier and the logits divided by its logits scaling. The mixer is Mamba-2
(archs.nemotron_h's: conv and ssm states in a slot of the engine's StatePool, `attn.states`) or GQA attention with
Granite's attention multiplier as its scale and no positional encoding; the MLP is SwiGLU (`shared_mlp`:
input_linear = [gate; up], output_linear). On the CPU with every matrix in GGUF block formats the whole stack runs
in the fused native stack (archs.granitehybrid.native_plan), else per-op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgeserve.errors import ModelLoadError
from edgeserve.kernels.dispatch import add_rms_norm, linear, rms_norm, write_kv
from edgeserve.kernels.formats.quant_linear import LinearWeight, PromptRows
from edgeserve.loaders.weights import WeightSource
from edgeserve.models.archs.nemotron_h.config import mamba2_dims
from edgeserve.models.archs.nemotron_h.model import (Mamba2HybridDecoder, Mamba2Weights, load_mamba2,
                                                     mamba2_dummy_shapes, run_mamba2)
from edgeserve.models.attention import KVAttention
from edgeserve.models.config import ModelConfig
from edgeserve.models.decoder_scaffold import next_norm, step_states
from edgeserve.models.moe import MoELayer, ffn_input_dtype
from edgeserve.models.moe_weights import load_moe_layer
from edgeserve.models.text_part import RenamedWeights
from edgeserve.models.weight_loader import WeightLoader

# HF Granite 4 H's expert tensors (`block_sparse_moe.*`, experts stacked [E, 2I, H] / [E, H, I]), by the names the
# shared MoE loader reads
_EXPERT_NAMES = {"mlp.gate.weight": "block_sparse_moe.router.layer.weight",
                 "mlp.experts.gate_up_proj": "block_sparse_moe.input_linear.weight",
                 "mlp.experts.down_proj": "block_sparse_moe.output_linear.weight"}


class GraniteExpertWeights(RenamedWeights):
    """An HF Granite 4 H checkpoint's expert tensors under the `mlp.*` names edgeserve.models.moe_weights reads."""

    def _name(self, name: str) -> str:
        head, sep, tail = name.partition(".mlp.")
        return f"{head}.{_EXPERT_NAMES.get('mlp.' + tail, 'mlp.' + tail)}" if sep else name

    def blocks(self, name: str):
        """GGUF block bytes (an HF source has none)."""
        return None


@dataclass
class GraniteHybridLayer:
    """One layer: its two norms, a Mamba-2 mixer (with its state index) or attention, and the SwiGLU MLP."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    gate_up: LinearWeight | None  # None where the MoE layer runs the MLP as its shared expert (a GGUF's)
    down: LinearWeight | None
    moe: MoELayer | None = None  # routed experts beside the MLP (Tiny, Small)
    mamba: Mamba2Weights | None = None
    state_index: int = -1
    qkv: LinearWeight | None = None
    o_proj: LinearWeight | None = None


class GraniteHybridModel(Mamba2HybridDecoder):
    """Granite 4 H over the engine's paged KV pool with the step's Mamba-2 states beside it (`attn.states`)."""

    layers: list[GraniteHybridLayer]  # type: ignore[assignment]
    plan_builder = ("edgeserve.models.archs.granitehybrid.native_plan", "build_granite")

    @classmethod
    def weight_view(cls, config: ModelConfig, source: WeightSource) -> WeightSource:
        """An HF MoE checkpoint's expert tensors under the shared MoE loader's names; other sources as they are."""
        if config.is_moe and getattr(source, "gguf", None) is None:
            return GraniteExpertWeights(source)
        return source

    @classmethod
    def load(cls, config: ModelConfig, w: WeightLoader) -> "GraniteHybridModel":
        """Build the model from its tensors (an HF checkpoint's names or a granitehybrid GGUF's)."""
        c, source, dtype = config, w.source, w.dtype
        is_gguf = getattr(source, "gguf", None) is not None
        dims, layers, index = mamba2_dims(c), [], 0
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            s = p + "shared_mlp."
            moe = load_moe_layer(c, source, i, w.matrix, w.device, dtype) if c.is_moe else None
            # a GGUF with experts holds the MLP as the shared expert (ffn_*_shexp), which the MoE layer runs
            mlp = moe is None or moe.shared is None
            gate_up = [s + "gate.weight", s + "up.weight"] if is_gguf else [s + "input_linear.weight"]
            layer = GraniteHybridLayer(input_norm=w.vector(p + "input_layernorm.weight"),
                                       post_norm=w.vector(p + "post_attention_layernorm.weight"),
                                       gate_up=w.matrix(gate_up) if mlp else None,
                                       down=w.matrix([s + "output_linear.weight"]) if mlp else None, moe=moe)
            if c.is_linear(i):
                layer.mamba = load_mamba2(dims, source, p + "mamba.", w.vector, w.matrix, is_gguf)
                layer.state_index, index = index, index + 1
            else:
                a = p + "self_attn."
                k = source.get(a + "k_proj.weight", keep_int4=False)
                if isinstance(k, torch.Tensor) and k.shape[0] != c.kv_size:
                    raise ModelLoadError(f"layer {i}: K projection of {k.shape[0]} rows, the config says "
                                         f"{c.num_kv_heads} KV heads x {c.head_dim} (a GGUF whose "
                                         "attention.head_count_kv is 0 on every layer cannot say its KV heads)")
                layer.qkv = w.matrix([a + f"{x}_proj.weight" for x in "qkv"])
                layer.o_proj = w.matrix([a + "o_proj.weight"])
            layers.append(layer)
        embed, lm_head = w.embed_and_head("model.embed_tokens.weight", c.tie_word_embeddings)
        return cls(c, embed, layers, w.vector("model.norm.weight"), lm_head, w.dtype, w.device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: KVAttention,
                prompt_rows: PromptRows | None = None) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] for a flat batch of T tokens, over the engine's paged KV pool and
        its Mamba-2 states (`attn.states`)."""
        states = step_states(attn, positions, self.max_positions, "Granite 4 H", "Mamba-2", needs=("__call__",))
        c = self.config
        eps, r = c.rms_norm_eps, c.residual_scale
        x = self.embed_rows(input_ids) * (c.embed_scale or 1.0)
        fused = self.native_forward(x, torch.zeros_like(positions), attn, states)  # no positional encoding
        if fused is not None:
            return fused
        h = rms_norm(x, self.layers[0].input_norm, eps).to(self.dtype)
        for i, layer in enumerate(self.layers):
            if layer.mamba is not None:
                y = run_mamba2(self, layer.mamba, layer.state_index, h, states, prompt_rows)
            else:
                q, k, v = linear(h, layer.qkv, None, prompt_rows).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
                t = h.shape[0]
                k_cache, v_cache, slots = attn.layer_cache(i)  # type: ignore[attr-defined]
                write_kv(k_cache, v_cache, k.reshape(t, c.num_kv_heads, c.head_dim),
                         v.reshape(t, c.num_kv_heads, c.head_dim), slots)
                o = attn.attend(i, q.reshape(t, c.num_heads, c.head_dim), scale=c.query_scale)  # type: ignore
                y = linear(o.to(self.dtype), layer.o_proj, None, prompt_rows)  # type: ignore[arg-type]
            h, x = add_rms_norm(y.float() * r, x, layer.post_norm, eps, ffn_input_dtype(layer, self.dtype))
            y = self._feed_forward(layer, h, prompt_rows)
            h, x = add_rms_norm(y.float() * r, x, next_norm(self, i), eps, self.dtype)
        return h


    def _feed_forward(self, layer: GraniteHybridLayer, h: torch.Tensor,
                      prompt_rows: PromptRows | None) -> torch.Tensor:
        """The SwiGLU MLP of normed h, plus the routed experts where the layer has them (float32 [T, hidden])."""
        y = layer.moe.forward(h) if layer.moe is not None else None
        if layer.gate_up is None or layer.down is None:
            assert y is not None
            return y
        gate, up = linear(h, layer.gate_up, None, prompt_rows).float().chunk(2, dim=-1)
        mlp = linear((torch.nn.functional.silu(gate) * up).to(self.dtype), layer.down, None, prompt_rows).float()
        return mlp if y is None else mlp + y


def model_class(config: ModelConfig) -> type[GraniteHybridModel]:
    """Granite 4 H's decoder."""
    return GraniteHybridModel


def dummy_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF names and shapes of a Granite 4 H model's tensors, for random weights (edgeserve.models.dummy)."""
    from edgeserve.models.dummy import attention_shapes, top_shapes

    c, h, d = config, config.hidden_size, mamba2_dims(config)
    shapes = top_shapes(c)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        w = c.intermediate_size
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "shared_mlp.input_linear.weight": (2 * w, h), p + "shared_mlp.output_linear.weight": (h, w)})
        if c.is_moe:
            e, m = c.num_experts, c.moe_intermediate_size
            shapes.update({p + "block_sparse_moe.router.layer.weight": (e, h),
                           p + "block_sparse_moe.input_linear.weight": (e, 2 * m, h),
                           p + "block_sparse_moe.output_linear.weight": (e, h, m)})
        if c.is_linear(i):
            shapes.update(mamba2_dummy_shapes(d, p + "mamba.", h))
        else:
            shapes.update(attention_shapes(c, p + "self_attn."))
    return shapes
