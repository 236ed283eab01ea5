"""Gemma 4 12B's encoder-free image embedder (transformers' Gemma4UnifiedVisionEmbedder, llama.cpp's `gemma4uv`
projector) in float32 torch: each merged patch's pixels (patch x pooling kernel on a side, in [0, 1], row, column,
channel order) through LayerNorm, one dense layer, LayerNorm, plus a learned column row and a learned row row of the
factorized position table, LayerNorm, a weightless RMSNorm and the projection into the language model. The same
weights from an HF folder (`model.vision_embedder.*`, `model.embed_vision.embedding_projection`) or an mmproj
(`v.patch_norm.1/2/3`, `v.patch_embd`, `v.position_embd`, `mm.input_projection`, the first two stored by llama.cpp's
converter with their pixel columns in channel-major order)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from edgeserve.errors import ModelLoadError

LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which transformers' embedder keeps

# our name -> (mmproj tensor, HF tensor)
_NAMES = {"ln1_w": ("v.patch_norm.1.weight", "model.vision_embedder.patch_ln1.weight"),
          "ln1_b": ("v.patch_norm.1.bias", "model.vision_embedder.patch_ln1.bias"),
          "dense_w": ("v.patch_embd.weight", "model.vision_embedder.patch_dense.weight"),
          "dense_b": ("v.patch_embd.bias", "model.vision_embedder.patch_dense.bias"),
          "ln2_w": ("v.patch_norm.2.weight", "model.vision_embedder.patch_ln2.weight"),
          "ln2_b": ("v.patch_norm.2.bias", "model.vision_embedder.patch_ln2.bias"),
          "positions": ("v.position_embd.weight", "model.vision_embedder.pos_embedding"),
          "ln3_w": ("v.patch_norm.3.weight", "model.vision_embedder.pos_norm.weight"),
          "ln3_b": ("v.patch_norm.3.bias", "model.vision_embedder.pos_norm.bias"),
          "proj": ("mm.input_projection.weight", "model.embed_vision.embedding_projection.weight")}


@dataclass
class PatchEmbedder:
    """The embedder's weights (float32), pixel columns in the processor's (row, column, channel) order."""

    ln1: tuple[torch.Tensor, torch.Tensor]  # over the merged patch's pixels
    dense: tuple[torch.Tensor, torch.Tensor]  # [width, pixels], [width]
    ln2: tuple[torch.Tensor, torch.Tensor]
    positions: torch.Tensor  # [2, table, width]: column rows, then row rows
    ln3: tuple[torch.Tensor, torch.Tensor]
    proj: torch.Tensor  # [lm hidden, width]
    rms_eps: float = 1e-6

    @property
    def width(self) -> int:
        return self.dense[0].shape[0]

    def forward(self, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """One image's LM rows [rows * cols, lm hidden] from its merged patches [rows * cols, pixels] (row-major,
        values in [0, 1])."""
        rows, cols = grid
        if max(rows, cols) > self.positions.shape[1]:
            raise ValueError(f"a {rows} x {cols} patch grid is past the {self.positions.shape[1]}-row position table")
        xs = torch.arange(cols).repeat(rows)
        ys = torch.arange(rows).repeat_interleave(cols)
        h = _layer_norm(patches.float(), self.ln1)
        h = _layer_norm(h @ self.dense[0].T + self.dense[1], self.ln2)
        h = _layer_norm(h + self.positions[0][xs] + self.positions[1][ys], self.ln3)
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.rms_eps, -0.5)
        return h @ self.proj.T


def _layer_norm(x: torch.Tensor, wb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), wb[0], wb[1], LAYER_NORM_EPS)


def load_embedder(weights: Any, gguf: bool, rms_eps: float, model_patch: int, path: Any) -> PatchEmbedder:
    """The embedder from an mmproj (`gguf`) or an HF checkpoint's WeightSource; `model_patch`: pixels on a merged
    patch's side."""
    def get(ours: str) -> torch.Tensor:
        name = _NAMES[ours][0 if gguf else 1]
        if not weights.has(name):
            raise ModelLoadError(f"{path}: tensor {name!r} is missing (not a Gemma 4 unified image embedder)")
        return torch.as_tensor(weights.get(name, False)).float()

    t = {ours: get(ours) for ours in _NAMES}
    pixels = model_patch * model_patch * 3
    if t["dense_w"].shape[1] != pixels:
        raise ModelLoadError(f"{path}: the patch projection takes {t['dense_w'].shape[1]} pixels, a "
                             f"{model_patch}-pixel merged patch has {pixels}")
    if gguf:  # the converter moved the pixel columns to channel-major order (ggml's im2col); back to the processor's
        order = _channel_major(model_patch)
        for key in ("dense_w", "ln1_w", "ln1_b"):
            back = torch.empty_like(t[key])
            back[..., order] = t[key]
            t[key] = back
    else:  # transformers' table is [table, 2, width]; the converter's [2, table, width]
        t["positions"] = t["positions"].permute(1, 0, 2)
    return PatchEmbedder(ln1=(t["ln1_w"], t["ln1_b"]), dense=(t["dense_w"], t["dense_b"]), ln2=(t["ln2_w"], t["ln2_b"]),
                         positions=t["positions"].contiguous(), ln3=(t["ln3_w"], t["ln3_b"]), proj=t["proj"],
                         rms_eps=rms_eps)


def _channel_major(p: int) -> torch.Tensor:
    """For each channel-major pixel position i (channel, row, column), its (row, column, channel) index: llama.cpp's
    converter's permutation."""
    i = torch.arange(p * p * 3)
    ch, row, col = i // (p * p), (i % (p * p)) // p, i % p
    return row * p * 3 + col * 3 + ch
