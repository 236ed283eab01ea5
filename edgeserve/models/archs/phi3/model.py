"""Phi-3: the Llama decoder over fused weights (`qkv_proj`, `gate_up_proj`; GGUF `attn_qkv`, a double `ffn_up`)
and Phi-3's "longrope" RoPE scaling.

Longrope scales each RoPE frequency by a per-frequency factor (short factors up to the original context, long
factors past it) and multiplies cos/sin by sqrt(1 + ln(scale) / ln(original context)). edgeserve uses the short
factors and caps the context at the original one (4k for Phi-3-mini-128k), where that is exactly what transformers
computes; the long factors would change every cached key once a sequence outgrows it.

Partial RoPE (Phi-4-mini: `partial_rotary_factor` 0.75, GGUF `rope.dimension_count` below the head size) rotates
only the first `rotary_dim` dims of each head. The q and k rows of each head are served in
`kernels.torch.rope.rope_permutation`'s order and the cos / sin tables padded with cos 1, sin 0 (`pad_rope_tables`), so
the decoder's full-head RoPE kernels do exactly that: q . k is the same under one permutation of both.
"""

from __future__ import annotations

import math

import torch

from edgeserve.kernels.cpu.native import BlockTensor
from edgeserve.kernels.formats.quant_linear import Q4Blocks, Q8Blocks
from edgeserve.kernels.torch.rope import pad_rope_tables, rope_cos_sin, rope_inv_freq, rope_permutation
from edgeserve.loaders.weights import WeightSource, WeightValue

from edgeserve.models.config import ModelConfig
from edgeserve.models.llama import LlamaModel

_SPLIT = {  # unfused name -> (fused name, which part)
    "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", 0),
    "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", 1),
    "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", 2),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", 1),
}


def _rows(value: WeightValue | BlockTensor, index: torch.Tensor) -> WeightValue | BlockTensor:
    if isinstance(value, (Q4Blocks, Q8Blocks, BlockTensor)):
        return value.rows(index)
    return value[index]


class Phi3Weights:
    """A WeightSource that serves Phi-3's fused matrices under the Llama decoder's unfused names (q and k rows in
    partial RoPE's order), and its longrope short factors as `rope_freqs` (per-frequency divisors; with partial
    RoPE the model applies them itself)."""

    def __init__(self, source: WeightSource, config: ModelConfig, short_factors: torch.Tensor | None):
        self.source = source
        c = config
        self._parts = {0: [c.q_size, c.kv_size, c.kv_size], 1: [c.intermediate_size, c.intermediate_size]}
        self.short_factors = short_factors
        self.config = config
        self.gguf = getattr(source, "gguf", None)
        d = c.head_dim
        perm = rope_permutation(d, c.rotary_dim) if c.rotary_dim else torch.arange(d)
        # row order of each part of qkv: q and k heads permuted (partial RoPE), v as it is
        self._qkv_rows = [torch.arange(c.q_size).view(-1, d)[:, perm].reshape(-1),
                          torch.arange(c.kv_size).view(-1, d)[:, perm].reshape(-1), torch.arange(c.kv_size)]

    def _split(self, name: str) -> tuple[str, int] | None:
        prefix, _, rest = name.rpartition("layers.")
        idx, _, local = rest.partition(".")
        if local in _SPLIT:
            fused, part = _SPLIT[local]
            return f"{prefix}layers.{idx}.{fused}", part
        return None

    def has(self, name: str) -> bool:
        if name == "rope_freqs":
            return self.short_factors is not None and not self.config.rotary_dim
        split = self._split(name)
        return self.source.has(split[0] if split else name)

    def get(self, name: str, keep_int4: bool) -> WeightValue:
        if name == "rope_freqs" and self.has(name):
            return self.short_factors
        split = self._split(name)
        if split is None:
            return self.source.get(name, keep_int4)
        return _rows(self.source.get(split[0], keep_int4), self._index(*split))

    def stored_quantized(self) -> list[str]:
        return self.source.stored_quantized()  # type: ignore[attr-defined]

    def blocks(self, name: str) -> BlockTensor | None:
        """The tensor's GGUF block bytes for the native CPU kernels (a part of a fused matrix: its rows), or None
        where the source has none."""
        blocks = getattr(self.source, "blocks", None)
        if blocks is None:
            return None
        split = self._split(name)
        if split is None:
            return blocks(name)
        value = blocks(split[0])
        return None if value is None else _rows(value, self._index(*split))

    def _index(self, fused: str, part: int) -> torch.Tensor:
        """The rows of part `part` of the fused matrix `fused`, in the order the decoder takes them."""
        sizes = self._parts[0 if "qkv" in fused else 1]
        start = sum(sizes[:part])
        rows = self._qkv_rows[part] if "qkv" in fused else torch.arange(sizes[part])
        return start + rows


class Phi3Model(LlamaModel):
    """Phi-3 over flat token batches (same interface as LlamaModel)."""

    @classmethod
    def from_weights(cls, config: ModelConfig, source: WeightSource, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu", keep_int4: bool = True,
                     dense_prefill: bool = False) -> "Phi3Model":
        """Build the model from a weight source with HF Phi-3 or GGUF phi3 names."""
        short = None
        scaling = config.rope_scaling
        if scaling is not None and scaling.kind == "longrope":
            gguf = getattr(source, "gguf", None)
            if scaling.short_factors:
                short = torch.tensor(scaling.short_factors, dtype=torch.float32)
            elif gguf is not None and "rope_factors_short.weight" in gguf.tensor_names():
                short = gguf.load_tensor("rope_factors_short.weight", torch.float32)
        model = super().from_weights(config, Phi3Weights(source, config, short), dtype, device, keep_int4,
                                     dense_prefill)
        assert isinstance(model, Phi3Model)
        if config.rotary_dim:  # RoPE over the first rotary_dim dims (short factors included), the rest unturned
            model.set_rope(rope_inv_freq(config.rotary_dim, config.rope_theta, config.rope_scaling, short))
        return model

    def __init__(self, config: ModelConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        scaling = config.rope_scaling
        if scaling is not None and scaling.kind == "longrope":
            self.max_positions = min(self.max_positions, scaling.original_max_position_embeddings)
            mscale = self._longrope_scale()
            self.cos, self.sin = self.cos[: self.max_positions] * mscale, self.sin[: self.max_positions] * mscale

    def _longrope_scale(self) -> float:
        """Longrope's factor on cos and sin (1.0 without longrope)."""
        c = self.config
        scaling = c.rope_scaling
        if scaling is None or scaling.kind != "longrope":
            return 1.0
        original = scaling.original_max_position_embeddings
        scale = c.max_position_embeddings / original
        if scaling.factor != 1.0:
            return scaling.factor
        return math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0

    def set_rope(self, inv_freq: torch.Tensor) -> None:
        """Rotate by `inv_freq` [rotary_dim // 2]: new cos / sin tables over the model's positions (longrope's scale
        included), the unrotated pairs of the permuted heads passed through."""
        cos, sin = rope_cos_sin(inv_freq, self.max_positions, self._longrope_scale())
        cos, sin = pad_rope_tables(cos, sin, self.config.head_dim)
        self.cos, self.sin = cos.to(self.device), sin.to(self.device)


def model_class(config: ModelConfig) -> type[LlamaModel]:
    """Llama's decoder over Phi-3's fused weights (edgeserve.models.registry's hook)."""
    return Phi3Model


def dummy_model_class(config: ModelConfig) -> type[LlamaModel]:
    """Random weights (edgeserve.models.dummy, unfused Llama names) run Llama's block with Phi-3's sizes."""
    return LlamaModel
