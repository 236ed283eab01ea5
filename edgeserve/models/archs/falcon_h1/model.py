"""The Falcon-H1 decoder over flat token batches (LlamaModel's interface).

Each layer: h = input_norm(x); x = x + attention(h) + mamba2(h); x = x + mlp(pre_ff_norm(x)). The attention is GQA
with NeoX RoPE over the paged KV pool; the Mamba-2 mixer (archs.nemotron_h's) continues from the layer's conv and
ssm states in a slot of the engine's StatePool (`attn.states`); the MLP is SwiGLU. The multipliers are in the
weights (a GGUF's by llama.cpp's converter; an HF checkpoint's scaled at load by FoldedScales, the same products).
The whole stack runs on the per-op path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgeserve.kernels.dispatch import add_rms_norm, linear, rms_norm, rope_write_kv
from edgeserve.kernels.formats.quant_linear import LinearWeight, PromptRows
from edgeserve.kernels.torch.rope import rope_cos_sin, rope_inv_freq
from edgeserve.loaders.weights import WeightSource, WeightValue
from edgeserve.models.archs.nemotron_h.config import mamba2_dims
from edgeserve.models.archs.nemotron_h.model import (Mamba2HybridDecoder, Mamba2Weights, load_mamba2,
                                                     mamba2_dummy_shapes, run_mamba2)
from edgeserve.models.attention import KVAttention
from edgeserve.models.config import ModelConfig
from edgeserve.models.decoder_scaffold import next_norm, step_states
from edgeserve.models.text_part import RenamedWeights
from edgeserve.models.weight_loader import WeightLoader


class FoldedScales(RenamedWeights):
    """An HF Falcon-H1 checkpoint with its multipliers folded into the tensors (ModelConfig.folded_scales), as
    llama.cpp's converter writes them into a GGUF."""

    def __init__(self, source: WeightSource, scales: tuple[tuple[str, object], ...]):
        super().__init__(source)
        self.scales = scales

    def get(self, name: str, keep_int4: bool) -> WeightValue:
        value = self.source.get(name, keep_int4)
        scale = next((s for suffix, s in self.scales if name.endswith(suffix)), None)
        if scale is None or not isinstance(value, torch.Tensor):
            return value
        if isinstance(scale, tuple):  # per-segment scales of the rows (in_proj's z / x / B / C / dt)
            sizes, factors = scale
            rows = torch.cat([torch.full((n,), f) for n, f in zip(sizes, factors)]).to(value.dtype)
            return value * rows.reshape(-1, *([1] * (value.dim() - 1)))
        return value * scale

    def blocks(self, name: str):
        """GGUF block bytes (an HF source has none)."""
        return None


@dataclass
class FalconH1Layer:
    """One layer: its two norms, attention and a Mamba-2 mixer side by side, and the SwiGLU MLP."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor  # pre_ff_layernorm
    qkv: LinearWeight
    o_proj: LinearWeight
    mamba: Mamba2Weights
    state_index: int
    gate_up: LinearWeight
    down: LinearWeight


class FalconH1Model(Mamba2HybridDecoder):
    """Falcon-H1 over the engine's paged KV pool with the step's Mamba-2 states beside it (`attn.states`)."""

    layers: list[FalconH1Layer]  # type: ignore[assignment]

    @classmethod
    def weight_view(cls, config: ModelConfig, source: WeightSource) -> WeightSource:
        """An HF checkpoint with its multipliers folded in; a GGUF as it is (folded by the converter)."""
        return source if getattr(source, "gguf", None) is not None else FoldedScales(source, config.folded_scales)

    @classmethod
    def load(cls, config: ModelConfig, w: WeightLoader) -> "FalconH1Model":
        """Build the model from its tensors (an HF checkpoint's names or a falcon-h1 GGUF's)."""
        c, src = config, w.source
        is_gguf = getattr(src, "gguf", None) is not None
        dims, layers = mamba2_dims(c), []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a, f = p + "self_attn.", p + "feed_forward."
            layers.append(FalconH1Layer(
                input_norm=w.vector(p + "input_layernorm.weight"), post_norm=w.vector(p + "pre_ff_layernorm.weight"),
                qkv=w.matrix([a + f"{x}_proj.weight" for x in "qkv"]), o_proj=w.matrix([a + "o_proj.weight"]),
                mamba=load_mamba2(dims, src, p + "mamba.", w.vector, w.matrix, is_gguf), state_index=i,
                gate_up=w.matrix([f + "gate_proj.weight", f + "up_proj.weight"]),
                down=w.matrix([f + "down_proj.weight"])))
        embed, lm_head = w.embed_and_head("model.embed_tokens.weight", c.tie_word_embeddings)
        model = cls(c, embed, layers, w.vector("model.final_layernorm.weight"), lm_head, w.dtype, w.device)
        inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, None, None)
        model.cos, model.sin = (t.to(w.device) for t in rope_cos_sin(inv_freq, model.max_positions))
        return model

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: KVAttention,
                prompt_rows: PromptRows | None = None) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] for a flat batch of T tokens, over the engine's paged KV pool and
        its Mamba-2 states (`attn.states`)."""
        states = step_states(attn, positions, self.max_positions, "Falcon-H1", "Mamba-2", needs=("__call__",))
        c = self.config
        eps, t = c.rms_norm_eps, input_ids.shape[0]
        cos, sin = self.cos[positions], self.sin[positions]
        x = self.embed_rows(input_ids)
        h = rms_norm(x, self.layers[0].input_norm, eps).to(self.dtype)
        for i, layer in enumerate(self.layers):
            y = run_mamba2(self, layer.mamba, layer.state_index, h, states, prompt_rows).float()
            q, k, v = linear(h, layer.qkv, None, prompt_rows).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            k_cache, v_cache, slots = attn.layer_cache(i)  # type: ignore[attr-defined]
            q = rope_write_kv(q.reshape(t, c.num_heads, c.head_dim), k.reshape(t, c.num_kv_heads, c.head_dim),
                              v.reshape(t, c.num_kv_heads, c.head_dim), cos, sin, k_cache, v_cache, slots)
            o = attn.attend(i, q)  # type: ignore[attr-defined]
            y = y + linear(o.to(self.dtype), layer.o_proj, None, prompt_rows).float()
            h, x = add_rms_norm(y, x, layer.post_norm, eps, self.dtype)
            gate, up = linear(h, layer.gate_up, None, prompt_rows).float().chunk(2, dim=-1)
            y = linear((torch.nn.functional.silu(gate) * up).to(self.dtype), layer.down, None, prompt_rows)
            h, x = add_rms_norm(y, x, next_norm(self, i), eps, self.dtype)
        return h


def model_class(config: ModelConfig) -> type[FalconH1Model]:
    """Falcon-H1's decoder (per-op path only)."""
    return FalconH1Model


def dummy_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF names and shapes of a Falcon-H1 model's tensors, for random weights (edgeserve.models.dummy)."""
    from edgeserve.models.dummy import attention_shapes, top_shapes

    c, h, d = config, config.hidden_size, mamba2_dims(config)
    shapes = top_shapes(c, norm="model.final_layernorm.weight")
    for i in range(c.num_layers):
        p, w = f"model.layers.{i}.", c.intermediate_size
        a, f = p + "self_attn.", p + "feed_forward."
        shapes.update(attention_shapes(c, a))
        shapes.update({p + "input_layernorm.weight": (h,), p + "pre_ff_layernorm.weight": (h,),
                       f + "gate_proj.weight": (w, h), f + "up_proj.weight": (w, h), f + "down_proj.weight": (h, w)})
        shapes.update(mamba2_dummy_shapes(d, p + "mamba.", h))
    return shapes
