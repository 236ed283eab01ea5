"""Gemma 4's vision encoder (transformers' Gemma4VisionModel, llama.cpp's `gemma4v` projector) in float32 torch:
patches in [0, 1] scaled to [-1, 1] and projected, plus a learned x and a learned y position row; pre/post-normed
blocks (RMSNorm weights as stored) with q/k RMSNorms, a weightless V RMSNorm, 2-D RoPE (the first half of each head
rotated by the patch's column, the second by its row, NeoX pairs, base 100), attention scale 1 over every patch,
a gated gelu_tanh MLP; then k x k average pooling, times sqrt(width), the optional standardization, a weightless
RMSNorm and the projection into the language model. Linears may clamp their input and output (clipped linears)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from edgeserve.errors import ModelLoadError
from edgeserve.vision.stop import check

# a block's weights: our name -> (mmproj name after `v.blk.N.`, HF name after `...encoder.layers.N.`)
_LAYER = {"q": ("attn_q", "self_attn.q_proj.linear"), "k": ("attn_k", "self_attn.k_proj.linear"),
          "v": ("attn_v", "self_attn.v_proj.linear"), "o": ("attn_out", "self_attn.o_proj.linear"),
          "gate": ("ffn_gate", "mlp.gate_proj.linear"), "up": ("ffn_up", "mlp.up_proj.linear"),
          "down": ("ffn_down", "mlp.down_proj.linear")}
_NORMS = {"q_norm": ("attn_q_norm", "self_attn.q_norm"), "k_norm": ("attn_k_norm", "self_attn.k_norm"),
          "ln1": ("ln1", "input_layernorm"), "attn_post": ("attn_post_norm", "post_attention_layernorm"),
          "ln2": ("ln2", "pre_feedforward_layernorm"), "ffn_post": ("ffn_post_norm", "post_feedforward_layernorm")}
_CLAMPS = ("input_min", "input_max", "output_min", "output_max")


@dataclass
class Linear:
    """A matrix [out, in] and, for a clipped linear, its input and output bounds."""

    weight: torch.Tensor
    bounds: tuple[float, float, float, float] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.bounds is None:
            return x @ self.weight.T
        lo, hi, out_lo, out_hi = self.bounds
        return (x.clamp(lo, hi) @ self.weight.T).clamp(out_lo, out_hi)


@dataclass
class Gemma4Tower:
    """The encoder's weights (float32) and shape."""

    patch: torch.Tensor  # [width, p * p * 3], columns in the processor's (row, column, channel) order
    positions: torch.Tensor  # [2, table, width]: column rows, then row rows
    layers: list[dict[str, Any]]
    proj: torch.Tensor  # [lm hidden, width]
    heads: int
    head_dim: int
    eps: float
    rope_theta: float = 100.0
    std: tuple[torch.Tensor, torch.Tensor] | None = None  # (bias, scale)
    _rope: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def width(self) -> int:
        return self.patch.shape[0]

    def forward(self, patches: torch.Tensor, grid: tuple[int, int], pool: int) -> torch.Tensor:
        """One image's LM rows [(rows / pool) * (cols / pool), lm hidden] from its patches [rows * cols, p*p*3]
        (row-major, values in [0, 1])."""
        rows, cols = grid
        xs = torch.arange(cols).repeat(rows)
        ys = torch.arange(rows).repeat_interleave(cols)
        h = (2.0 * patches - 1.0) @ self.patch.T + self.positions[0][xs] + self.positions[1][ys]
        cos, sin = self._rope_table(rows, cols)
        for layer in self.layers:
            check()
            h = h + _rms(self._attention(layer, _rms(h, layer["ln1"], self.eps), cos, sin), layer["attn_post"],
                         self.eps)
            y = _rms(h, layer["ln2"], self.eps)
            y = layer["down"](F.gelu(layer["gate"](y), approximate="tanh") * layer["up"](y))
            h = h + _rms(y, layer["ffn_post"], self.eps)
        grid_h = h.T.reshape(1, self.width, rows, cols)
        pooled = F.avg_pool2d(grid_h, pool, pool).flatten(2)[0].T * math.sqrt(self.width)
        if self.std is not None:
            pooled = (pooled - self.std[0]) * self.std[1]
        return _rms(pooled, None, self.eps) @ self.proj.T

    def _attention(self, layer: dict[str, Any], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Bidirectional attention of every patch over every patch (scale 1)."""
        n, d = x.shape[0], self.head_dim
        q = _rope(_rms(layer["q"](x).view(n, -1, d), layer["q_norm"], self.eps), cos, sin)
        k = _rope(_rms(layer["k"](x).view(n, -1, d), layer["k_norm"], self.eps), cos, sin)
        v = _rms(layer["v"](x).view(n, -1, d), None, self.eps)
        group = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(group, dim=1) if group > 1 else t for t in (k, v))
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=1.0)
        return layer["o"](o.transpose(0, 1).reshape(n, -1))

    def _rope_table(self, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin [patches, 1, head_dim]: each half of a head rotates by one axis (columns, then rows)."""
        if (rows, cols) not in self._rope:
            half = self.head_dim // 2
            inv = 1.0 / (self.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))
            xs = torch.arange(cols, dtype=torch.float32).repeat(rows)
            ys = torch.arange(rows, dtype=torch.float32).repeat_interleave(cols)
            fx, fy = xs[:, None] * inv, ys[:, None] * inv
            angles = torch.cat([fx, fx, fy, fy], dim=-1)[:, None, :]
            self._rope[(rows, cols)] = angles.cos(), angles.sin()
        return self._rope[(rows, cols)]


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma 4's RMSNorm (weight as stored; None: no weight)."""
    y = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return y if weight is None else y * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX RoPE within each half of the heads [n, heads, d]."""
    a, b = x.chunk(2, dim=-1)
    rotated = torch.cat([_half_rotated(a), _half_rotated(b)], dim=-1)
    return x * cos + rotated * sin


def _half_rotated(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def load_tower(weights: Any, gguf: bool, layers: int, heads: int, eps: float, path: Any) -> Gemma4Tower:
    """The encoder from an mmproj (`gguf`: llama.cpp's `v.*` / `mm.*` names) or an HF checkpoint's
    `model.vision_tower.*` / `model.embed_vision.*`."""
    def get(name: str) -> torch.Tensor:
        if not weights.has(name):
            raise ModelLoadError(f"{path}: tensor {name!r} is missing")
        return torch.as_tensor(weights.get(name, False)).float()

    top = "v." if gguf else "model.vision_tower."
    blocks = [_layer(get, weights, f"v.blk.{i}." if gguf else f"{top}encoder.layers.{i}.", gguf)
              for i in range(layers)]
    patch = get("v.patch_embd.weight" if gguf else top + "patch_embedder.input_proj.weight")
    if gguf:  # the converter stored it as a [width, 3, p, p] convolution
        patch = patch.permute(0, 2, 3, 1).reshape(patch.shape[0], -1)
    std = None
    if weights.has(top + "std_bias"):
        std = (get(top + "std_bias"), get(top + "std_scale"))
    return Gemma4Tower(
        patch=patch.contiguous(),
        positions=get("v.position_embd.weight" if gguf else top + "patch_embedder.position_embedding_table"),
        layers=blocks, proj=get("mm.input_projection.weight" if gguf else "model.embed_vision.embedding_projection.weight"),
        heads=heads, head_dim=blocks[0]["q_norm"].shape[0], eps=eps, std=std)


def _layer(get, weights: Any, prefix: str, gguf: bool) -> dict[str, Any]:
    """One block's linears (with their clamps where stored) and norms."""
    out: dict[str, Any] = {}
    for ours, names in _LAYER.items():
        base = prefix + names[0 if gguf else 1]
        clip = base.removesuffix(".linear")  # HF keeps the bounds on the clipped linear, beside its `linear`
        bounds = None
        if weights.has(f"{clip}.input_min"):
            bounds = tuple(float(get(f"{clip}.{c}").reshape(-1)[0]) for c in _CLAMPS)
        out[ours] = Linear(get(base + ".weight"), bounds)  # type: ignore[arg-type]
    for ours, names in _NORMS.items():
        out[ours] = get(prefix + names[0 if gguf else 1] + ".weight")
    return out
