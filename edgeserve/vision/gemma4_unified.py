"""Gemma 4 12B's vision (HF `gemma4_unified`, Gemma4UnifiedForConditionalGeneration; llama.cpp's `gemma4uv` mmproj):
encoder-free. Each image resized as Gemma 4's processor does (vision/gemma4.py's target_size: sides whole multiples
of patch x pooling kernel, bicubic), cut into merged patches of patch x kernel pixels on a side (the processor's 3 x 3
merge of its 16-pixel patches: one LM row each), through vision/gemma4_patch_embed.py, written into the prompt as
Gemma 4's `<|image>` + one `<|image|>` per row + `<image|>`. An image's tokens attend to each other both ways on the
sliding layers (`use_bidirectional_attention: vision`, this model's default; an mmproj does not say, and every
released unified model has it), causally on the global ones (archs/gemma4/model.py)."""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from edgeserve.errors import ModelLoadError
from edgeserve.vision.family import PreparedImage, VisionSource, register
from edgeserve.vision.gemma4 import cut_patches, image_tokens, patch_cut
from edgeserve.vision.gemma4_patch_embed import load_embedder
from edgeserve.vision.tower import MmprojWeights, identity_digest


class Gemma4UnifiedVision:
    """Gemma 4 12B's VisionFamily. The embedder computes on the CPU in float32 whatever the model's dtype and device
    (one dense layer per image: the engine moves the rows to the model)."""

    projector_type = "gemma4uv"
    bidirectional_images = True  # per model: __init__

    def __init__(self, source: VisionSource, lm_config: Any, dtype: torch.dtype = torch.float32,
                 device: torch.device = torch.device("cpu")):
        self.patch_size, self.pool, self.max_tokens = patch_cut(source)
        if source.gguf is not None:
            eps = float(source.gguf.metadata.get("clip.vision.attention.layer_norm_epsilon", 1e-6))
            weights: Any = MmprojWeights(source.gguf)
        else:
            v = source.config.get("vision_config") or {}
            eps = float(v.get("rms_norm_eps", 1e-6))
            text = source.config.get("text_config") or {}
            self.bidirectional_images = text.get("use_bidirectional_attention", "vision") == "vision"
            weights = source.weights
        self.embedder = load_embedder(weights, source.gguf is not None, eps, self.patch_size * self.pool,
                                      source.path)
        lm_hidden = getattr(lm_config, "hidden_size", None)
        if lm_hidden is not None and self.embedder.proj.shape[0] != lm_hidden:
            raise ModelLoadError(f"{source.path}: the projector maps to {self.embedder.proj.shape[0]} wide rows, the "
                                 f"language model is {lm_hidden} wide")
        self._digest = identity_digest(source, self.projector_type, self.patch_size, self.pool, self.max_tokens)

    def preprocess(self, image: Image.Image) -> PreparedImage:
        """Resized as Gemma 4's processor does, rescaled to [0, 1], cut into merged patches
        [rows * cols, (patch * pool)^2 * 3] (row-major; each patch's pixels row, column, channel)."""
        side = self.patch_size * self.pool
        patches, rows, cols = cut_patches(image, self.patch_size, self.pool, self.max_tokens, side)
        return PreparedImage(patches, (rows, cols), rows * cols)

    def prompt_tokens(self, prepared: PreparedImage, tokenizer: Any) -> tuple[list[int], int]:
        return image_tokens(prepared, tokenizer)

    def encode(self, images: list[PreparedImage]) -> list[torch.Tensor]:
        """Each image through the embedder: [num_tokens, lm_hidden] float32."""
        with torch.inference_mode():
            return [self.embedder.forward(p.pixel_values, p.grid) for p in images]  # type: ignore[arg-type]

    def settings_digest(self) -> bytes:
        return self._digest


@register("gemma4uv", "gemma4_unified")
def _gemma4_unified(source: VisionSource, lm_config: Any, **kw: Any) -> Gemma4UnifiedVision:
    return Gemma4UnifiedVision(source, lm_config, **kw)
