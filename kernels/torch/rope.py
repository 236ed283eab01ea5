"""Rotary position embeddings (rotate-half / NeoX layout), with linear, llama-3 and YaRN frequency scaling."""

from __future__ import annotations

import math

import torch

from edgeserve.kernels.formats.kv_quant import is_quantized
from edgeserve.kernels.torch.paged_attention import write_kv


def rope_inv_freq(head_dim: int, theta: float, scaling=None, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], scaled as the model asks."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if freq_factors is not None:  # GGUF llama-3 models carry the scaling as per-frequency divisors
        inv = inv / freq_factors.double()
    elif scaling is not None and scaling.kind == "linear":
        inv = inv / scaling.factor
    elif scaling is not None and scaling.kind == "llama3":
        old = scaling.original_max_position_embeddings
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = torch.where(mid, (1 - smooth) * inv / scaling.factor + smooth * inv, scaled)
    elif scaling is not None and scaling.kind == "yarn":
        return yarn_inv_freq(head_dim, theta, scaling)
    return inv.float()


def yarn_inv_freq(head_dim: int, theta: float, scaling) -> torch.Tensor:
    """YaRN's inverse frequencies [head_dim // 2] (arXiv 2309.00071): the frequencies that rotate fewer than
    `beta_slow` times over the original context interpolated (divided by `factor`), those that rotate more than
    `beta_fast` times kept, a linear ramp between (its ends rounded outwards when `truncate`). float32, as
    transformers computes it."""
    def boundary(rotations: float) -> float:  # the dimension whose wavelength fits `rotations` times
        return head_dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = boundary(scaling.beta_fast), boundary(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    keep = 1 - ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return (1.0 / (scaling.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def rope_permutation(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Partial RoPE as a full-head rotation: perm[j] is the head dim to put at position j so that the rotated dims'
    rotate-half pairs (i, i + rotary_dim / 2) land on the full head's (i, i + head_dim / 2) and the unrotated dims
    fill the rest (the identity when rotary_dim == head_dim). Apply it to the q and k rows of each head (q . k is
    unchanged) and rotate with `pad_rope_tables`' tables: the unrotated pairs do not turn."""
    half, rh = head_dim // 2, rotary_dim // 2
    rest = (head_dim - rotary_dim) // 2
    return torch.cat([torch.arange(rh), rotary_dim + torch.arange(rest), rh + torch.arange(rh),
                      rotary_dim + rest + torch.arange(head_dim - rotary_dim - rest)])[:2 * half]


def pad_rope_tables(cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin tables [positions, rotary_dim // 2] widened to [positions, head_dim // 2] for heads in
    `rope_permutation`'s order: the unrotated pairs get cos 1 and sin 0 (passed through, unscaled)."""
    pad = head_dim // 2 - cos.shape[-1]
    return (torch.cat([cos, cos.new_ones(*cos.shape[:-1], pad)], dim=-1),
            torch.cat([sin, sin.new_zeros(*sin.shape[:-1], pad)], dim=-1))


def rope_attention_factor(scaling) -> float:
    """The factor a scaling multiplies cos and sin by: YaRN's `attention_factor`, by default 0.1 ln(factor) + 1
    (1.0 for the other kinds here; Phi-3's longrope applies its own in edgeserve.models.archs.phi3)."""
    if scaling is None or scaling.kind != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    return 0.1 * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0


def rope_cos_sin(inv_freq: torch.Tensor, max_positions: int,
                 attention_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_positions, head_dim // 2], times `attention_factor` (YaRN's mscale)."""
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    if attention_factor == 1.0:
        return freqs.cos(), freqs.sin()
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim] by per-token cos/sin [tokens, head_dim // 2], in float32."""
    x = x.float()
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Rotate q [T, H, D] and k [T, Hkv, D] by per-token cos/sin [T, D // 2], store the rotated k and v [T, Hkv, D]
    at their slots of one layer's pool, and return the rotated q in the cache's dtype (rotation in float32; in q's
    dtype, bfloat16 or float32, for a q8_0 pool)."""
    nh = q.shape[1]
    qk = apply_rope(torch.cat([q, k], dim=1), cos, sin)  # one rotation for both: fewer small ops per layer
    write_kv(k_cache, v_cache, qk[:, nh:], v, slot_mapping)
    return qk[:, :nh].to(q_dtype(q, k_cache))


def q_dtype(q: torch.Tensor, k_cache: torch.Tensor) -> torch.dtype:
    """The dtype rope_write_kv returns the rotated q in: the cache's, or for a quantized pool (q8_0 or fp8) bfloat16
    when q is bfloat16 and float32 otherwise; float32 for a float16 pool beside another compute dtype (the CPU's
    bf16 compute with an f16 KV cache keeps its queries float32, as the native stack does)."""
    if is_quantized(k_cache):
        return torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32
    if k_cache.dtype == torch.float16 and q.dtype != torch.float16:
        return torch.float32
    return k_cache.dtype
