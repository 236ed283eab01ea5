"""Phi-3: the Llama decoder over fused weights (`qkv_proj`, `gate_up_proj`; GGUF `attn_qkv`, a double `ffn_up`)
and Phi-3's "longrope" RoPE scaling.

Longrope scales each RoPE frequency by a per-frequency factor (short factors up to the original context, long
factors past it) and multiplies cos/sin by sqrt(1 + ln(scale) / ln(original context)). edgeserve uses the short
factors and caps the context at the original one (4k for Phi-3-mini-128k), where that is exactly what transformers
computes; the long factors would change every cached key once a sequence outgrows it.
"""

from __future__ import annotations

import math

import torch

from edgeserve.kernels.cpu_native import BlockTensor
from edgeserve.kernels.quant_linear import Q4Blocks, Q8Blocks
from edgeserve.loaders.weights import WeightSource, WeightValue

from .config import ModelConfig
from .llama import LlamaModel

_SPLIT = {  # unfused name -> (fused name, which part)
    "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", 0),
    "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", 1),
    "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", 2),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", 1),
}


def _rows(value: WeightValue | BlockTensor, start: int, stop: int) -> WeightValue | BlockTensor:
    if isinstance(value, (Q4Blocks, Q8Blocks, BlockTensor)):
        return value.rows(torch.arange(start, stop))
    return value[start:stop]


class Phi3Weights:
    """A WeightSource that serves Phi-3's fused matrices under the Llama decoder's unfused names, and its
    longrope short factors as `rope_freqs` (per-frequency divisors)."""

    def __init__(self, source: WeightSource, config: ModelConfig, short_factors: torch.Tensor | None):
        self.source = source
        c = config
        self._parts = {0: [c.q_size, c.kv_size, c.kv_size], 1: [c.intermediate_size, c.intermediate_size]}
        self.short_factors = short_factors
        self.gguf = getattr(source, "gguf", None)

    def _split(self, name: str) -> tuple[str, int] | None:
        prefix, _, rest = name.rpartition("layers.")
        idx, _, local = rest.partition(".")
        if local in _SPLIT:
            fused, part = _SPLIT[local]
            return f"{prefix}layers.{idx}.{fused}", part
        return None

    def has(self, name: str) -> bool:
        if name == "rope_freqs":
            return self.short_factors is not None
        split = self._split(name)
        return self.source.has(split[0] if split else name)

    def get(self, name: str, keep_int4: bool) -> WeightValue:
        if name == "rope_freqs" and self.short_factors is not None:
            return self.short_factors
        split = self._split(name)
        if split is None:
            return self.source.get(name, keep_int4)
        fused, part = split
        value = self.source.get(fused, keep_int4)
        sizes = self._parts[0 if "qkv" in fused else 1]
        start = sum(sizes[:part])
        return _rows(value, start, start + sizes[part])

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
        fused, part = split
        value = blocks(fused)
        if value is None:
            return None
        sizes = self._parts[0 if "qkv" in fused else 1]
        start = sum(sizes[:part])
        return _rows(value, start, start + sizes[part])


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
        return model

    def __init__(self, config: ModelConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        scaling = config.rope_scaling
        if scaling is not None and scaling.kind == "longrope":
            original = scaling.original_max_position_embeddings
            self.max_positions = min(self.max_positions, original)
            self.cos, self.sin = self.cos[: self.max_positions], self.sin[: self.max_positions]
            scale = config.max_position_embeddings / original
            mscale = scaling.factor if scaling.factor != 1.0 else (
                math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
            self.cos, self.sin = self.cos * mscale, self.sin * mscale
