"""Gemma 3's vision: SigLIP, then its projector (average-pool to mm_tokens_per_image rows, soft-embedding
RMSNorm, a linear map into the language model). One fixed-size image; pan-and-scan is off (as transformers'
processor defaults and llama.cpp)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image

from edgeserve.errors import ModelLoadError
from edgeserve.vision.family import PreparedImage, VisionSource, register
from edgeserve.vision.tower import Normalize, identity_digest, load_tower, normalize_from, special_id, vit_config
from edgeserve.vision.vit import patchify

BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
_HF_TOWERS = ("vision_tower.vision_model.", "vision_tower.", "model.vision_tower.", "model.vision_tower.vision_model.")
_HF_PROJECTORS = ("model.multi_modal_projector.", "multi_modal_projector.")


def _prefix(weights: Any, candidates: tuple[str, ...], tensor: str, path: Any) -> str:
    for p in candidates:
        if weights.has(p + tensor):
            return p
    raise ModelLoadError(f"{path}: no {tensor} under {' / '.join(candidates)}")


class Gemma3Vision:
    """Gemma 3's VisionFamily."""

    projector_type = "gemma3"
    # the language model's prefill lets an image's tokens attend to each other both ways (transformers' Gemma 3
    # mask: causal OR same image, on every layer)
    bidirectional_images = True

    def __init__(self, source: VisionSource, lm_config: Any, dtype: torch.dtype = torch.float32,
                 device: torch.device = torch.device("cpu")):
        self.config, self.image_size = vit_config(source)
        self.normalize = normalize_from(source, Normalize())
        patches = self.image_size // self.config.patch_size
        if source.gguf is not None:
            self.pool = int(source.gguf.metadata.get("clip.vision.projector.scale_factor", 4))
            self.tower, weights, _ = load_tower(source, self.config, "", dtype, device)
            self.proj = weights.get("mm.input_projection.weight", False)  # [vision hidden, lm hidden]
            self.soft_norm = weights.get("mm.soft_emb_norm.weight", False)  # the converter added Gemma's 1
        else:
            assert source.config is not None
            per_side = math.isqrt(int(source.config.get("mm_tokens_per_image", 256)))
            self.pool = patches // per_side
            tower = _prefix(source.weights, _HF_TOWERS, "embeddings.patch_embedding.weight", source.path)
            self.tower, weights, _ = load_tower(source, self.config, tower, dtype, device)
            proj = _prefix(weights, _HF_PROJECTORS, "mm_input_projection_weight", source.path)
            self.proj = weights.get(proj + "mm_input_projection_weight", False)
            self.soft_norm = weights.get(proj + "mm_soft_emb_norm.weight", False) + 1.0
        self.proj = self.proj.float().to(device)
        self.soft_norm = self.soft_norm.float().to(device)
        if patches % self.pool:
            raise ModelLoadError(f"{source.path}: {patches} patches per side do not pool by {self.pool}")
        self.tokens = (patches // self.pool) ** 2
        lm_hidden = getattr(lm_config, "hidden_size", None)
        if lm_hidden is not None and self.proj.shape[1] != lm_hidden:
            raise ModelLoadError(f"{source.path}: the projector maps to {self.proj.shape[1]} wide rows, the language "
                                 f"model is {lm_hidden} wide")
        self._digest = identity_digest(source, self.projector_type, self.image_size, self.pool, self.normalize)

    def preprocess(self, image: Image.Image) -> PreparedImage:
        """Resized to the tower's square (bilinear), rescaled and normalized: [3, S, S]."""
        size = self.image_size
        pixels = self.normalize(image.convert("RGB").resize((size, size), Image.Resampling.BILINEAR))
        return PreparedImage(pixels, (size // self.config.patch_size,) * 2, self.tokens)

    def prompt_tokens(self, prepared: PreparedImage, tokenizer: Any) -> tuple[list[int], int]:
        """"\\n\\n<start_of_image>" + num_tokens soft tokens + "<end_of_image>\\n\\n" (the processor's expansion of the
        template's <start_of_image>)."""
        nl = tokenizer.encode("\n\n", add_special_tokens=False)
        # the placeholders' own embeddings are replaced: a vocabulary without the soft token (Gemma 3 270M's, 1B's)
        # lets any token stand in (the padding token), as llama.cpp needs none
        soft = special_id(tokenizer, SOFT, tokenizer.token_to_id("<pad>") or 0)
        ids = nl + [special_id(tokenizer, BOI)] + [soft] * prepared.num_tokens + [special_id(tokenizer, EOI)] + nl
        return ids, len(nl) + 1

    def encode(self, images: list[PreparedImage]) -> list[torch.Tensor]:
        """SigLIP over the batch, pooled, soft-normed and projected: [num_tokens, lm_hidden] each."""
        if not images:
            return []
        c = self.config
        pixels = torch.stack([p.pixel_values for p in images]).to(self.proj.device)
        hidden, _ = self.tower.forward(patchify(pixels, c.patch_size))
        b, n, d = hidden.shape
        side = math.isqrt(n)
        grid = hidden.transpose(1, 2).reshape(b, d, side, side)
        pooled = F.avg_pool2d(grid, self.pool, self.pool).flatten(2).transpose(1, 2)
        normed = pooled * torch.rsqrt(pooled.pow(2).mean(-1, keepdim=True) + c.layer_norm_eps) * self.soft_norm
        return list((normed @ self.proj).unbind(0))

    def settings_digest(self) -> bytes:
        return self._digest


@register("gemma3")
def _gemma3(source: VisionSource, lm_config: Any, **kw: Any) -> Gemma3Vision:
    return Gemma3Vision(source, lm_config, **kw)
