"""Gemma 4's vision (E2B / E4B / 26B-A4B / 31B; llama.cpp's `gemma4v` mmproj, or the HF folder of
Gemma4ForConditionalGeneration): each image resized keeping its aspect ratio to at most `max_soft_tokens` pooled
tokens (sides whole multiples of patch x pooling kernel, bicubic), its patches through the encoder of
vision/gemma4_tower.py, written into the prompt as `<|image>` + one `<|image|>` per row + `<image|>`. An image's tokens attend to each other both ways on the sliding layers where the
language model's config says `use_bidirectional_attention: vision` (an mmproj, which does not say: llama.cpp's rule,
every size but E2B's and E4B's widths), else causally (archs/gemma4/model.py keeps the global layers causal)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from PIL import Image

from edgeserve.errors import ModelLoadError
from edgeserve.vision.family import PreparedImage, VisionSource, register
from edgeserve.vision.gemma4_tower import load_tower
from edgeserve.vision.tower import MmprojWeights, identity_digest, special_id

BOI, SOFT, EOI = "<|image>", "<|image|>", "<image|>"
# llama.cpp's gemma4v defaults (its mmproj stores neither): a 3 x 3 pooling kernel; transformers' processor default
POOL, MAX_SOFT_TOKENS = 3, 280
# llama.cpp's gemma4v: E2B's and E4B's language models (these widths) read images causally, the others both ways
CAUSAL_WIDTHS = (1536, 2560)


def patch_cut(source: VisionSource) -> tuple[int, int, int]:
    """(patch size, pooling kernel, soft-token budget) of a Gemma 4 vision source: from an mmproj's keys (which hold
    no budget: MAX_SOFT_TOKENS) or an HF folder's preprocessor and vision config."""
    if source.gguf is not None:
        meta = source.gguf.metadata
        return (int(meta["clip.vision.patch_size"]), int(meta.get("clip.vision.projector.scale_factor") or POOL),
                MAX_SOFT_TOKENS)
    assert source.config is not None
    v, pre = source.config.get("vision_config") or {}, source.preprocessor or {}
    return (int(pre.get("patch_size", v.get("patch_size", 16))),
            int(pre.get("pooling_kernel_size", v.get("pooling_kernel_size", POOL))),
            int(pre.get("max_soft_tokens", MAX_SOFT_TOKENS)))


class Gemma4Vision:
    """Gemma 4's VisionFamily."""

    projector_type = "gemma4v"
    bidirectional_images = False  # per model: __init__

    def __init__(self, source: VisionSource, lm_config: Any, dtype: torch.dtype = torch.float32,
                 device: torch.device = torch.device("cpu")):
        self.device = device
        self.patch_size, self.pool, self.max_tokens = patch_cut(source)
        if source.gguf is not None:
            meta = source.gguf.metadata
            eps = float(meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6))
            self.tower = load_tower(MmprojWeights(source.gguf), True, int(meta["clip.vision.block_count"]),
                                    int(meta["clip.vision.attention.head_count"]), eps, source.path)
        else:
            v = source.config.get("vision_config") or {}
            theta = float((v.get("rope_parameters") or {}).get("rope_theta", 100.0))
            self.tower = load_tower(source.weights, False, int(v.get("num_hidden_layers", 16)),
                                    int(v.get("num_attention_heads", 12)), float(v.get("rms_norm_eps", 1e-6)),
                                    source.path)
            self.tower.rope_theta = theta
        lm_hidden = getattr(lm_config, "hidden_size", None)
        if source.gguf is not None:
            self.bidirectional_images = lm_hidden is not None and lm_hidden not in CAUSAL_WIDTHS
        else:
            text = (source.config or {}).get("text_config") or {}
            self.bidirectional_images = text.get("use_bidirectional_attention") == "vision"
        if lm_hidden is not None and self.tower.proj.shape[0] != lm_hidden:
            raise ModelLoadError(f"{source.path}: the projector maps to {self.tower.proj.shape[0]} wide rows, the "
                                 f"language model is {lm_hidden} wide")
        self._digest = identity_digest(source, self.projector_type, self.patch_size, self.pool, self.max_tokens)

    def preprocess(self, image: Image.Image) -> PreparedImage:
        """Resized (bicubic) to the largest size of whole pooled cells within the token budget, rescaled to [0, 1]
        and cut into patches [rows * cols, p * p * 3] (row-major; each patch's pixels row, column, channel)."""
        patches, rows, cols = cut_patches(image, self.patch_size, self.pool, self.max_tokens, self.patch_size)
        return PreparedImage(patches, (rows, cols), (rows // self.pool) * (cols // self.pool))

    def prompt_tokens(self, prepared: PreparedImage, tokenizer: Any) -> tuple[list[int], int]:
        return image_tokens(prepared, tokenizer)

    def encode(self, images: list[PreparedImage]) -> list[torch.Tensor]:
        """Each image through the encoder and projector: [num_tokens, lm_hidden] float32."""
        with torch.inference_mode():
            return [self.tower.forward(p.pixel_values.to(self.device), p.grid, self.pool)  # type: ignore[arg-type]
                    for p in images]

    def settings_digest(self) -> bytes:
        return self._digest


def image_tokens(prepared: PreparedImage, tokenizer: Any) -> tuple[list[int], int]:
    """`<|image>` + num_tokens `<|image|>` + `<image|>` (the processor's expansion of the template's `<|image|>`)
    and the offset of the first placeholder."""
    ids = [special_id(tokenizer, BOI)] + [special_id(tokenizer, SOFT)] * prepared.num_tokens
    return ids + [special_id(tokenizer, EOI)], 1


def cut_patches(image: Image.Image, patch: int, pool: int, max_tokens: int, side: int) -> tuple[torch.Tensor, int, int]:
    """The image resized (bicubic) to target_size(patch, pool, max_tokens), rescaled to [0, 1] and cut into
    side x side patches [rows * cols, side * side * 3] (row-major; each patch's pixels row, column, channel), with
    rows and cols."""
    img = image.convert("RGB")
    height, width = target_size(img.height, img.width, patch, pool, max_tokens)
    if (height, width) != (img.height, img.width):
        img = img.resize((width, height), Image.Resampling.BICUBIC)
    a = (np.asarray(img).astype(np.float64) * (1 / 255)).astype(np.float32)  # [H, W, 3]
    rows, cols = height // side, width // side
    patches = a.reshape(rows, side, cols, side, 3).transpose(0, 2, 1, 3, 4).reshape(rows * cols, side * side * 3)
    return torch.from_numpy(np.ascontiguousarray(patches)), rows, cols


def target_size(height: int, width: int, patch: int, pool: int, max_tokens: int) -> tuple[int, int]:
    """The processor's aspect-preserving size: the largest sides, whole multiples of patch * pool, whose patches
    number at most max_tokens * pool^2 (a side that rounds to nothing gets one cell)."""
    max_patches = max_tokens * pool * pool
    factor = math.sqrt(max_patches * patch * patch / (height * width))
    cell = pool * patch
    h, w = int(math.floor(factor * height / cell)) * cell, int(math.floor(factor * width / cell)) * cell
    longest = (max_patches // pool ** 2) * cell
    if h == 0:
        h, w = cell, min(int(math.floor(width / height)) * cell, longest)
    elif w == 0:
        h, w = min(int(math.floor(height / width)) * cell, longest), cell
    return h, w


@register("gemma4v", "gemma4")
def _gemma4(source: VisionSource, lm_config: Any, **kw: Any) -> Gemma4Vision:
    return Gemma4Vision(source, lm_config, **kw)
