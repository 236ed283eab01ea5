"""The OLMo 2 / OLMo 3 decoder (`olmo2` in GGUF; HF Olmo2ForCausalLM, Olmo3ForCausalLM): the Llama decoder's weights
with OLMo's block.

Differences from Llama: no RMSNorm before attention or the MLP; one after each (on its output, before the residual
add); the Q/K RMSNorm spans the whole q / k projection rather than each head; OLMo 3's sliding-window layers (3 of
every 4) rotate by plain RoPE where the global layers may scale it (YaRN). The fused native CPU stack normalizes
each layer's input, so it does not run this block: it takes the per-op path below.
"""

from __future__ import annotations

import torch

from edgeserve.kernels.dispatch import linear, rms_norm, rope_write_kv
from edgeserve.kernels.formats.quant_linear import PromptRows
from edgeserve.kernels.torch.rope import apply_rope, rope_cos_sin, rope_inv_freq
from edgeserve.loaders.weights import WeightSource, WeightValue

from edgeserve.models.attention import KVAttention
from edgeserve.models.config import ModelConfig
from edgeserve.models.llama import LlamaModel
from edgeserve.models.text_part import text_part


class Olmo2Weights:
    """A WeightSource seen through the Llama decoder's names: the pre-attention norm the Llama loader reads
    (`input_layernorm`, which OLMo 2 has not) is served as ones and left unused."""

    def __init__(self, source: WeightSource, hidden: int):
        self.source = text_part(source)
        self.hidden = hidden

    def has(self, name: str) -> bool:
        return name.endswith(".input_layernorm.weight") or self.source.has(name)

    def get(self, name: str, keep_int4: bool) -> WeightValue:
        if name.endswith(".input_layernorm.weight"):
            return torch.ones(self.hidden)
        return self.source.get(name, keep_int4)

    def blocks(self, name: str):
        blocks = getattr(self.source, "blocks", None)
        return None if blocks is None else blocks(name)

    def stored_quantized(self) -> list[str]:
        return self.source.stored_quantized()  # type: ignore[attr-defined]


class Olmo2Model(LlamaModel):
    """OLMo 2 / OLMo 3 over flat token batches (same interface as LlamaModel). A layer's `post_norm` is its norm
    after attention; `post_ffn_norms[i]` the one after its MLP; `q_norm` / `k_norm` are [heads * head_dim]."""

    post_ffn_norms: list[torch.Tensor]

    @classmethod
    def from_weights(cls, config: ModelConfig, source: WeightSource, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu", keep_int4: bool = True,
                     dense_prefill: bool = False) -> "Olmo2Model":
        """Build the model from a weight source (HF or GGUF names), as LlamaModel.from_weights does."""
        names = Olmo2Weights(source, config.hidden_size)
        model = super().from_weights(config, names, dtype, device, keep_int4, dense_prefill)
        assert isinstance(model, Olmo2Model)
        model.post_ffn_norms = [
            names.get(f"model.layers.{i}.post_feedforward_layernorm.weight", keep_int4=False).float()
            .to(torch.device(device)) for i in range(config.num_layers)]  # type: ignore[union-attr]
        return model

    def __init__(self, config: ModelConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.cos_local, self.sin_local = self.cos, self.sin
        if config.rope_scaling is not None and config.layer_windows is not None:  # plain RoPE on sliding layers
            inv = rope_inv_freq(config.head_dim, config.rope_theta)
            self.cos_local, self.sin_local = (t.to(self.device) for t in rope_cos_sin(inv, self.max_positions))

    def native_decoder(self) -> None:
        """None: the fused native stack has no block without pre-norms (the per-op path runs OLMo)."""
        return None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: KVAttention,
                prompt_rows: PromptRows | None = None) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] for a flat batch of T tokens at the given positions."""
        c = self.config
        eps = c.rms_norm_eps
        x = self.embed_rows(input_ids)  # the float32 residual stream
        rope_global = self.cos[positions], self.sin[positions]
        rope_local = (self.cos_local[positions], self.sin_local[positions]) if self.cos_local is not self.cos \
            else rope_global
        paged = hasattr(attn, "layer_cache") and hasattr(attn, "attend")
        windows = c.layer_windows or (None,) * len(self.layers)
        t = x.shape[0]
        for i, layer in enumerate(self.layers):
            window = windows[i]
            cos, sin = rope_global if window is None else rope_local
            qkv = linear(x.to(self.dtype), layer.qkv, layer.qkv_bias, prompt_rows)
            q = rms_norm(qkv[:, : c.q_size], layer.q_norm, eps).view(t, c.num_heads, c.head_dim)
            k = rms_norm(qkv[:, c.q_size: c.q_size + c.kv_size], layer.k_norm, eps).view(t, c.num_kv_heads,
                                                                                          c.head_dim)
            v = qkv[:, c.q_size + c.kv_size:].view(t, c.num_kv_heads, c.head_dim)
            if paged:
                k_cache, v_cache, slots = attn.layer_cache(i)  # type: ignore[attr-defined]
                q = rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
                o = attn.attend(i, q, window=window)  # type: ignore[attr-defined]
            else:
                q, k = apply_rope(q, cos, sin).to(self.dtype), apply_rope(k, cos, sin).to(self.dtype)
                o = attn(i, q, k, v.to(self.dtype), window=window)  # type: ignore[call-arg]
            x = x + rms_norm(linear(o, layer.o_proj, None, prompt_rows), layer.post_norm, eps)
            y = self.mlp(layer, x.to(self.dtype), prompt_rows)
            x = x + rms_norm(y, self.post_ffn_norms[i], eps)
        return rms_norm(x, self.norm, eps).to(self.dtype)


def model_class(config: ModelConfig) -> type[Olmo2Model]:
    """OLMo 2's block, no pre-norms (edgeserve.models.registry's hook)."""
    return Olmo2Model
