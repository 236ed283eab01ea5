"""The Gemma 2 / Gemma 3 decoder: the Llama decoder's weights plus Gemma's block.

Differences from Llama, all read from ModelConfig: embeddings scaled by sqrt(hidden), RMSNorm after attention and
after the MLP as well as before them ("sandwich" norms), a GELU-tanh gated MLP, interleaved sliding-window and
global attention layers (Gemma 3's sliding layers with their own RoPE base), Q/K RMSNorm (Gemma 3), a query scale
from `query_pre_attn_scalar`, and attention / output logit soft-capping (Gemma 2). Gemma's (1 + w) RMSNorm is a
plain RMSNorm over 1 + w: GGUF files store 1 + w already, HF checkpoints store w (`norm_offset` adds the 1).
"""

from __future__ import annotations

import torch

from edgeserve.kernels.dispatch import add_rms_norm, gelu_tanh_and_mul, linear, rms_norm, rope_write_kv, softcap
from edgeserve.kernels.formats.quant_linear import Int8Weight, PromptRows
from edgeserve.kernels.torch.rope import apply_rope, rope_cos_sin, rope_inv_freq
from edgeserve.loaders.weights import WeightSource, WeightValue

from edgeserve.models.attention import KVAttention
from edgeserve.models.config import ModelConfig
from edgeserve.models.llama import LlamaModel, merge_image_rows
from edgeserve.models.text_part import text_part

# How many positions the RoPE tables cover at most (they are float32 [positions, head_dim / 2] each, two per base).
MAX_ROPE_TABLE = 32768


class GemmaWeights:
    """A WeightSource seen through the Llama decoder's names: its pre-MLP norm slot
    (`post_attention_layernorm`) is Gemma's `pre_feedforward_layernorm`, and norm weights get `norm_offset`.
    `sandwich(i)` gives layer i's post-attention and post-MLP norms."""

    def __init__(self, source: WeightSource, config: ModelConfig):
        self.source = source
        self.offset = config.norm_offset
        self.gguf = getattr(source, "gguf", None)  # GGUF names the two extra norms itself

    def _hf_name(self, name: str) -> str:
        if self.gguf is None and name.endswith(".post_attention_layernorm.weight"):
            return name.replace(".post_attention_layernorm.", ".pre_feedforward_layernorm.")
        return name

    def has(self, name: str) -> bool:
        return self.source.has(self._hf_name(name))

    def get(self, name: str, keep_int4: bool) -> WeightValue:
        value = self.source.get(self._hf_name(name), keep_int4)
        if self.offset and name.endswith("norm.weight") and isinstance(value, torch.Tensor):
            value = value.float() + self.offset
        return value

    def stored_quantized(self) -> list[str]:
        return self.source.stored_quantized()  # type: ignore[attr-defined]

    def blocks(self, name: str):
        """The tensor's GGUF block bytes for the native CPU kernels (None where the source has none): without
        this, every Gemma weight took the torch fallback on CPU."""
        blocks = getattr(self.source, "blocks", None)
        return None if blocks is None else blocks(self._hf_name(name))

    def sandwich(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's post-attention and post-MLP norm weights (float32, offset applied)."""
        if self.gguf is not None:
            names = (f"blk.{i}.post_attention_norm.weight", f"blk.{i}.post_ffw_norm.weight")
            return tuple(self.gguf.load_tensor(n, torch.float32) for n in names)  # type: ignore[return-value]
        p = f"model.layers.{i}."
        # straight from the source: `get` would rename post_attention_layernorm to the pre-MLP norm
        return tuple(self.source.get(p + n, keep_int4=False).float() + self.offset  # type: ignore[return-value, union-attr]
                     for n in ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight"))


class GemmaModel(LlamaModel):
    """Gemma 2 / Gemma 3 over flat token batches (same interface as LlamaModel)."""

    post_attn_norms: list[torch.Tensor]
    post_ffn_norms: list[torch.Tensor]

    @classmethod
    def from_weights(cls, config: ModelConfig, source: WeightSource, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu", keep_int4: bool = True,
                     dense_prefill: bool = False) -> "GemmaModel":
        """Build the model from a weight source (HF or GGUF names), as LlamaModel.from_weights does."""
        names = GemmaWeights(text_part(source), config)  # a Gemma 3 vision model's decoder is its language_model
        model = super().from_weights(config, names, dtype, device, keep_int4, dense_prefill)
        assert isinstance(model, GemmaModel)
        dev = torch.device(device)
        norms = [names.sandwich(i) for i in range(config.num_layers)]
        model.post_attn_norms = [a.to(dev) for a, _ in norms]
        model.post_ffn_norms = [b.to(dev) for _, b in norms]
        return model

    def __init__(self, config: ModelConfig, embed: torch.Tensor | Int8Weight, layers: list, norm: torch.Tensor,
                 lm_head, inv_freq: torch.Tensor, dtype: torch.dtype, device: torch.device):
        super().__init__(config, embed, layers, norm, lm_head, inv_freq, dtype, device)
        self.max_positions = min(config.max_position_embeddings, MAX_ROPE_TABLE)
        self.cos, self.sin = (t.to(device) for t in rope_cos_sin(inv_freq.cpu(), self.max_positions))
        self.cos_local, self.sin_local = self.cos, self.sin
        if config.rope_local_theta is not None:
            local = rope_inv_freq(config.head_dim, config.rope_local_theta, None, None)
            self.cos_local, self.sin_local = (t.to(device) for t in rope_cos_sin(local, self.max_positions))
        self.embed_scale = torch.tensor(config.embed_scale or 1.0, dtype=torch.float32)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: KVAttention,
                prompt_rows: PromptRows | None = None,
                image_rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] for a flat batch of T tokens at the given positions (see LlamaModel).

        On the CPU, when every weight runs on the native kernels and `attn` is the engine's paged pool, the whole
        stack runs as one native call (`native_decoder`), with the same kernels in the same order as below (each
        residual add fused with the norm after it), so its results are this path's, bit for bit."""
        c = self.config
        eps = c.rms_norm_eps
        x = merge_image_rows(self.embed_rows(input_ids) * self.embed_scale.to(input_ids.device), image_rows)
        fused = self.fused_forward(x, positions, attn)
        if fused is not None:
            return fused
        rope_global = self.cos[positions], self.sin[positions]
        rope_local = (self.cos_local[positions], self.sin_local[positions]) if self.cos_local is not self.cos \
            else rope_global
        paged = hasattr(attn, "layer_cache") and hasattr(attn, "attend")
        windows = c.layer_windows or (None,) * len(self.layers)
        h = rms_norm(x, self.layers[0].input_norm, eps).to(self.dtype)
        for i, layer in enumerate(self.layers):
            window = windows[i]
            cos, sin = rope_global if window is None else rope_local
            q, k, v = self.project_qkv(layer, h, prompt_rows)
            if paged:
                k_cache, v_cache, slots = attn.layer_cache(i)  # type: ignore[attr-defined]
                q = rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
                o = attn.attend(i, q, window=window, softcap=c.attn_softcap,  # type: ignore[attr-defined]
                                scale=c.query_scale)
            else:
                o = attn(i, apply_rope(q, cos, sin).to(self.dtype), apply_rope(k, cos, sin).to(self.dtype),  # type: ignore[call-arg]
                         v.to(self.dtype), window=window, softcap=c.attn_softcap, scale=c.query_scale)
            o = rms_norm(linear(o, layer.o_proj, None, prompt_rows), self.post_attn_norms[i], eps)
            h, x = add_rms_norm(o, x, layer.post_norm, eps, self.dtype)
            y = linear(gelu_tanh_and_mul(linear(h, layer.gate_up, None, prompt_rows)), layer.down, None, prompt_rows)
            y = rms_norm(y, self.post_ffn_norms[i], eps)
            last = i + 1 == len(self.layers)
            h, x = add_rms_norm(y, x, self.norm if last else self.layers[i + 1].input_norm, eps, self.dtype)
        return h


def model_class(config: ModelConfig) -> type[LlamaModel]:
    """Gemma's block (edgeserve.models.registry's hook)."""
    return GemmaModel


def dummy_model_class(config: ModelConfig) -> type[LlamaModel]:
    """Random weights (edgeserve.models.dummy, Llama's names) run Llama's block with Gemma's sizes."""
    return LlamaModel
