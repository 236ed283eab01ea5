"""The LFM3 decoder over flat token batches (LlamaModel's interface): LFM2's decoder (archs.lfm2) with sliding-window
layers, per-kind RoPE, a per-head output gate and sandwich norms.

Each layer is x = x + post_operator_norm(mixer(operator_norm(x))); x = x + post_ffn_norm(ffn(ffn_norm(x))), the
final norm `embedding_norm`. The mixer is LFM2's gated short convolution (kernels.short_conv, its conv state a slot
of the engine's StatePool) or GQA attention over the paged KV pool: q, k, v and the gate g projected in one matmul
from the normed input h, per-head Q/K RMSNorm, RoPE (the sliding layers' own base; on the global layers proportional
RoPE: the tail frequency pairs do not turn), attention (a sliding layer over its last `window` tokens), each head's
output times sigmoid(g_head), then o_proj. Steps run the whole stack as one native call where its plan fits
(models.archs.lfm3.native_plan: the same kernels in the same order as the path below).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgeserve.kernels.cpu.decoder import NativeDecoder
from edgeserve.kernels.dispatch import linear, rms_norm, rope_write_kv, sigmoid_gate
from edgeserve.kernels.formats.quant_linear import LinearWeight, PromptRows
from edgeserve.kernels.torch.rope import rope_cos_sin, rope_inv_freq
from edgeserve.loaders.weights import WeightSource
from edgeserve.models.archs.lfm2.model import Lfm2Layer, Lfm2Model, conv_shapes
from edgeserve.models.config import ModelConfig
from edgeserve.models.text_part import text_part
from edgeserve.models.weight_loader import WeightLoader


@dataclass
class Lfm3Layer(Lfm2Layer):
    """LFM2's layer (its `post_norm` is the pre-FFN `ffn_norm`) plus the sandwich norms, the attention layers' gate
    rows (stacked after q, k, v in `qkv`) and window."""

    gated: bool = False  # `qkv` ends with the per-head gate's rows
    window: int | None = None


class Lfm3Model(Lfm2Model):
    """LFM3 over the engine's paged KV pool (sliding and global layers) with the step's conv states beside it."""

    layers: list[Lfm3Layer]  # type: ignore[assignment]

    @classmethod
    def weight_view(cls, config: ModelConfig, source: WeightSource) -> WeightSource:
        """The text model's names (an HF checkpoint's or an lfm3 GGUF file's)."""
        return text_part(source)

    NAME = "LFM3"
    LAYER = Lfm3Layer

    @classmethod
    def _extra_norms(cls, w: WeightLoader, prefix: str) -> dict:
        """The sandwich norms, where the checkpoint has them."""
        return {field: w.tensor(prefix + name) if w.source.has(prefix + name) else None
                for field, name in (("post_mixer_norm", "post_operator_norm.weight"),
                                    ("post_ffn_norm", "post_ffn_norm.weight"))}

    @staticmethod
    def _attention_weights(c: ModelConfig, w: WeightLoader, layer: Lfm3Layer, i: int) -> None:
        """Layer i's attention: q, k, v (and the gate, where the checkpoint has one) stacked, Q/K norms, o_proj."""
        a = f"model.layers.{i}.self_attn."
        gate = next((a + n for n in ("gate_proj.weight", "g_proj.weight") if w.source.has(a + n)), None)
        layer.qkv = w.matrix([a + f"{x}_proj.weight" for x in "qkv"] + ([gate] if gate else []))
        layer.gated = gate is not None
        layer.q_norm, layer.k_norm = w.tensor(a + "q_norm.weight"), w.tensor(a + "k_norm.weight")
        layer.o_proj = w.matrix([a + "o_proj.weight"])
        layer.window = None if c.is_global(i) else c.layer_windows[i]  # type: ignore[index]

    @staticmethod
    def _inv_freq(c: ModelConfig, w: WeightLoader) -> torch.Tensor:
        """The global layers' inverse frequencies: proportional RoPE's tail pairs do not turn (a GGUF's `rope_freqs`
        divisors say which, 1e30 for those; else `rope_global_partial`), as archs.gemma4's global layers."""
        rope_freqs = w.tensor("rope_freqs") if w.source.has("rope_freqs") else None
        inv = rope_inv_freq(c.head_dim, c.rope_theta, None, None if rope_freqs is None else rope_freqs.reshape(-1))
        if rope_freqs is None and c.rope_global_partial < 1.0:
            inv[int(c.rope_global_partial * c.head_dim // 2):] = 0.0
        return inv

    def __init__(self, config: ModelConfig, embed, layers: list[Lfm3Layer], norm: torch.Tensor,
                 lm_head: LinearWeight, inv_freq: torch.Tensor, dtype: torch.dtype, device: torch.device):
        super().__init__(config, embed, layers, norm, lm_head, inv_freq, dtype, device)  # type: ignore[arg-type]
        local = rope_inv_freq(config.head_dim, config.rope_local_theta or 10_000.0, None, None)
        self.cos_local, self.sin_local = (t.to(device) for t in rope_cos_sin(local, self.max_positions))

    def native_plan(self) -> NativeDecoder | None:
        """The fused plan (models.archs.lfm3.native_plan); None where it does not apply."""
        from edgeserve.models.archs.lfm3.native_plan import build_lfm3

        return build_lfm3(self)

    def _ropes(self, positions: torch.Tensor) -> dict:
        """The step's (cos, sin) of the global (None) and sliding ("local") layers."""
        return {None: (self.cos[positions], self.sin[positions]),
                "local": (self.cos_local[positions], self.sin_local[positions])}

    def _attention(self, i: int, layer: Lfm3Layer, h: torch.Tensor, attn, ropes: dict,  # type: ignore[override]
                   prompt_rows: PromptRows | None) -> torch.Tensor:
        """Attention layer i's output [T, hidden] for its normed input h: gated heads through o_proj."""
        rope = ropes[None if layer.window is None else "local"]
        c, t = self.config, h.shape[0]
        heads, kvh, d, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        qkv = linear(h, layer.qkv, None, prompt_rows)  # type: ignore[arg-type]
        q = rms_norm(qkv[:, : c.q_size].reshape(-1, d), layer.q_norm, eps).view(t, heads, d)  # type: ignore[arg-type]
        k = rms_norm(qkv[:, c.q_size: c.q_size + c.kv_size].reshape(-1, d), layer.k_norm,  # type: ignore[arg-type]
                     eps).view(t, kvh, d)
        v = qkv[:, c.q_size + c.kv_size: c.q_size + 2 * c.kv_size].reshape(t, kvh, d)
        k_cache, v_cache, slots = attn.layer_cache(i)
        q = rope_write_kv(q, k, v, rope[0], rope[1], k_cache, v_cache, slots)
        o = attn.attend(i, q, window=layer.window)
        if layer.gated:  # one gate per head, expanded over its values (the native kernel reads it once per head)
            gate = qkv[:, c.q_size + 2 * c.kv_size:].float()
            o = sigmoid_gate(o.view(t, heads, d), gate[:, :, None].expand(t, heads, d)).view(t, heads * d)
        return linear(self.matmul_input(o), layer.o_proj, None,  # type: ignore[arg-type]
                      prompt_rows)


def model_class(config: ModelConfig) -> type[Lfm3Model]:
    """LFM3's decoder (its native plan: models.archs.lfm3.native_plan)."""
    return Lfm3Model


def dummy_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF names and shapes of an LFM3 model's tensors, for random weights (edgeserve.models.dummy)."""
    c, h = config, config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h),
                                          "model.embedding_norm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    for i in range(c.num_layers):
        p, f, w = f"model.layers.{i}.", f"model.layers.{i}.feed_forward.", c.intermediate_size
        norms = ("operator_norm", "ffn_norm") + (("post_operator_norm", "post_ffn_norm") if c.sandwich_norms else ())
        shapes.update({p + n + ".weight": (h,) for n in norms})
        shapes.update({f + "w1.weight": (w, h), f + "w3.weight": (w, h), f + "w2.weight": (h, w)})
        if c.is_linear(i):
            shapes.update(conv_shapes(c, p))
        else:
            a = p + "self_attn."
            shapes.update({a + "q_proj.weight": (c.q_size, h), a + "k_proj.weight": (c.kv_size, h),
                           a + "v_proj.weight": (c.kv_size, h), a + "o_proj.weight": (h, c.q_size),
                           a + "gate_proj.weight": (c.num_heads, h),
                           a + "q_norm.weight": (c.head_dim,), a + "k_norm.weight": (c.head_dim,)})
    return shapes
