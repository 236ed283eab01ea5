"""SmolVLM / Idefics3's vision: the image resized (longest edge), split into square tiles plus a downsized global
view, each tile through SigLIP, pixel-shuffled (scale_factor^2 patches per row) and projected by one linear map.
In the prompt each tile is `<fake_token_around_image><row_R_col_C>` and its image tokens, rows end in a newline,
and the global view closes it (`<global-img>`), as transformers' Idefics3Processor writes it."""

from __future__ import annotations

import math
from typing import Any

import torch
from PIL import Image

from edgeserve.errors import ModelLoadError
from edgeserve.vision.family import PreparedImage, VisionSource, register
from edgeserve.vision.tower import Normalize, identity_digest, load_tower, normalize_from, special_id, vit_config
from edgeserve.vision.vit import patchify

FAKE, IMAGE, GLOBAL = "<fake_token_around_image>", "<image>", "<global-img>"
_HF_TOWERS = ("model.vision_model.", "vision_model.")
_HF_CONNECTORS = ("model.connector.modality_projection.proj.weight", "connector.modality_projection.proj.weight")
MAX_SIDE = 4096  # transformers' cap on a resized image's side


def _fit_longest(width: int, height: int, longest: int) -> tuple[int, int]:
    """The processor's first resize: the longest side becomes `longest` (up or down), the other follows the aspect
    ratio rounded up to even; then both are kept under MAX_SIDE."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    width, height = max(width, 1), max(height, 1)
    if width >= height and width > MAX_SIDE:
        width, height = MAX_SIDE, int(MAX_SIDE / aspect)
    elif height > width and height > MAX_SIDE:
        height, width = MAX_SIDE, int(MAX_SIDE * aspect)
    return max(width, 1), max(height, 1)


def _tile_multiple(width: int, height: int, tile: int) -> tuple[int, int]:
    """The second resize: both sides rounded up to whole tiles, the shorter one through the aspect ratio."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return width, height


class Idefics3Vision:
    """SmolVLM / Idefics3's VisionFamily."""

    projector_type = "idefics3"
    bidirectional_images = False  # causal throughout, as transformers' Idefics3

    def __init__(self, source: VisionSource, lm_config: Any, dtype: torch.dtype = torch.float32,
                 device: torch.device = torch.device("cpu")):
        self.config, self.tile = vit_config(source, eps=1e-5)
        self.normalize = normalize_from(source, Normalize())
        if source.gguf is not None:
            meta = source.gguf.metadata
            self.scale = int(meta.get("clip.vision.projector.scale_factor", 2))
            self.longest = int(meta.get("clip.vision.preproc_image_size", self.tile * 4))
            self.split = True
            self.tower, weights, matrix = load_tower(source, self.config, "", dtype, device)
            self.proj = matrix(["mm.model.fc.weight"])
        else:
            assert source.config is not None
            pre = source.preprocessor or {}
            self.scale = int(source.config.get("scale_factor", 2))
            self.longest = int((pre.get("size") or {}).get("longest_edge", self.tile * 4))
            self.tile = int((pre.get("max_image_size") or {}).get("longest_edge", self.tile))
            self.split = bool(pre.get("do_image_splitting", True))
            weights = source.weights
            tower = next((p for p in _HF_TOWERS if weights.has(p + "embeddings.patch_embedding.weight")), None)
            proj = next((n for n in _HF_CONNECTORS if weights.has(n)), None)
            if tower is None or proj is None:
                raise ModelLoadError(f"{source.path}: no Idefics3 vision tower / connector weights")
            self.tower, _, matrix = load_tower(source, self.config, tower, dtype, device)
            self.proj = matrix([proj])
        lm_hidden = getattr(lm_config, "hidden_size", None)
        if lm_hidden is not None and self.proj.shape[0] != lm_hidden:
            raise ModelLoadError(f"{source.path}: the projector maps to {self.proj.shape[0]} wide rows, the language "
                                 f"model is {lm_hidden} wide")
        patches = self.tile // self.config.patch_size
        if patches % self.scale:
            raise ModelLoadError(f"{source.path}: {patches} patches per side do not shuffle by {self.scale}")
        self.tokens = (patches // self.scale) ** 2
        self._digest = identity_digest(source, self.projector_type, self.tile, self.longest, self.split, self.scale,
                                       self.normalize)

    def preprocess(self, image: Image.Image) -> PreparedImage:
        """Tiles (row-major) then the global view, each [3, tile, tile]: pixel_values [n, 3, tile, tile]; grid is
        (rows, cols), (0, 0) for an unsplit image."""
        img, lanczos = image.convert("RGB"), Image.Resampling.LANCZOS
        t = self.tile
        if not self.split:
            frames, rows, cols = [img.resize((t, t), lanczos)], 0, 0
        else:
            img = img.resize(_fit_longest(*img.size, self.longest), lanczos)
            img = img.resize(_tile_multiple(*img.size, t), lanczos)
            w, h = img.size
            if w > t or h > t:
                rows, cols = h // t, w // t
                frames = [img.crop((c * t, r * t, c * t + t, r * t + t)) for r in range(rows) for c in range(cols)]
                frames.append(img.resize((t, t), lanczos))
            else:
                frames, rows, cols = [img], 0, 0
        pixels = torch.stack([self.normalize(f) for f in frames])
        return PreparedImage(pixels, (rows, cols), self.tokens * len(frames))

    def prompt_tokens(self, prepared: PreparedImage, tokenizer: Any) -> tuple[list[int], int]:
        """The processor's expansion of an `<image>`: tiles with their row/col tags, then the global view."""
        fake, image, glob = (special_id(tokenizer, t) for t in (FAKE, IMAGE, GLOBAL))
        run = [image] * self.tokens
        rows, cols = prepared.grid
        ids: list[int] = []
        if rows or cols:
            newline = tokenizer.encode("\n", add_special_tokens=False)
            for r in range(rows):
                for c in range(cols):
                    ids += [fake] + tokenizer.encode(f"<row_{r + 1}_col_{c + 1}>", add_special_tokens=False) + run
                ids += newline
            ids += newline
        ids += [fake, glob] + run + [fake]
        return ids, ids.index(image)

    def encode(self, images: list[PreparedImage]) -> list[torch.Tensor]:
        """Each image's tiles through the tower, pixel-shuffled and projected: [num_tokens, lm_hidden]."""
        if not images:
            return []
        c = self.config
        frames = torch.cat([p.pixel_values for p in images])
        hidden, _ = self.tower.forward(patchify(frames, c.patch_size))
        rows = self.tower.linear(pixel_shuffle(hidden, self.scale), self.proj, None)
        return list(rows.reshape(-1, rows.shape[-1]).split([p.num_tokens for p in images]))

    def settings_digest(self) -> bytes:
        return self._digest


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[B, N, D] patches of a square grid as [B, N / scale^2, D * scale^2]: each scale x scale block of patches
    becomes one row (Idefics3's order)."""
    b, n, d = x.shape
    side = math.isqrt(n)
    x = x.view(b, side, side // scale, d * scale).permute(0, 2, 1, 3)
    x = x.reshape(b, side // scale, side // scale, d * scale * scale).permute(0, 2, 1, 3)
    return x.reshape(b, n // (scale * scale), d * scale * scale)


@register("idefics3", "smolvlm")
def _idefics3(source: VisionSource, lm_config: Any, **kw: Any) -> Idefics3Vision:
    return Idefics3Vision(source, lm_config, **kw)
