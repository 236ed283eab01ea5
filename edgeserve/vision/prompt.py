"""A rendered chat prompt with image markers as token ids, each image's placeholder span placed in them."""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from edgeserve.engine.cache.prefix_key import PrefixKey
from edgeserve.models.mrope import MRopePositions, mrope_positions
from edgeserve.vision.family import PreparedImage, VisionFamily
from edgeserve.vision.images import image_digest

# What an image part becomes in a message's text for the chat template: unguessable (a client cannot forge it),
# numbered process-wide
_NONCE = secrets.token_hex(8)
_MARK = re.compile(rf"<\|image-{_NONCE}-(\d+)\|>")


def image_mark(index: int) -> str:
    """The text that stands for image `index` (a process-wide number) in its message until the prompt is
    tokenized."""
    return f"<|image-{_NONCE}-{index}|>"


def has_marks(text: str) -> bool:
    return _MARK.search(text) is not None


@dataclass
class PlacedImage:
    """One image of a prompt: where its placeholders are, what preprocessing made of it, its key."""

    runs: list[tuple[int, int]]  # (position, count) of each run of placeholders (Idefics3: one per tile)
    prepared: PreparedImage
    key: bytes  # pixel digest + projector/preprocessing settings (VisionRuntime.key)

    @property
    def start(self) -> int:
        return self.runs[0][0]

    @property
    def stop(self) -> int:
        return self.runs[-1][0] + self.runs[-1][1]

    def rows(self, embeds: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """The image's embedding rows split over its placeholder runs: (position, rows) each."""
        out, used = [], 0
        for pos, n in self.runs:
            out.append((pos, embeds[used:used + n]))
            used += n
        return out


def placeholder_runs(ids: list[int], offset: int, base: int) -> list[tuple[int, int]]:
    """The runs of the placeholder id `ids[offset]` in `ids`, from `offset` on, at prompt positions `base` + i."""
    runs: list[tuple[int, int]] = []
    tid = ids[offset]
    for i in range(offset, len(ids)):
        if ids[i] != tid:
            continue
        if runs and runs[-1][0] + runs[-1][1] == base + i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((base + i, 1))
    return runs


@dataclass
class ImagePrompt:
    """A prompt's token ids with its images placed."""

    ids: list[int]
    images: list[PlacedImage]

    def mrope(self, family: VisionFamily) -> MRopePositions | None:
        """The prompt's M-RoPE positions where the family places images on a (t, h, w) grid (Qwen-VL's
        `mrope_grid`), else None."""
        grid = getattr(family, "mrope_grid", None)
        if grid is None or not self.images:
            return None
        return mrope_positions(len(self.ids), [(p.start, grid(p.prepared)) for p in self.images])

    def prefix_key(self) -> PrefixKey:
        """The spans that make every block an image's tokens touch hash by that image."""
        return PrefixKey(spans=tuple((p.start, p.stop, p.key) for p in self.images))

    def attend_spans(self, family: VisionFamily) -> list[tuple[int, int]]:
        """The [start, end) placeholder runs whose tokens attend to each other both ways in prefill, where the family
        asks for it (`bidirectional_images`: Gemma 3), else none."""
        if not family.bidirectional_images:
            return []
        return [(pos, pos + n) for p in self.images for pos, n in p.runs]

    def engine_images(self, embeds: list[torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
        """The engine request's image rows (request_state.ImageRows) for each image's embeddings."""
        return [run for p, e in zip(self.images, embeds) for run in p.rows(e)]

    def engine_request(self, family: VisionFamily, embeds: list[torch.Tensor]) -> dict[str, Any]:
        """The engine request's image arguments (AsyncEngine.submit): `prefix_key`, `images`, and where the family
        needs them a Qwen-VL prompt's `mrope` and a Gemma 3 prompt's `attend_spans`."""
        request: dict[str, Any] = {"prefix_key": self.prefix_key(), "images": self.engine_images(embeds)}
        mrope = self.mrope(family)
        if mrope is not None:
            request["mrope"] = mrope
        spans = self.attend_spans(family)
        if spans:
            request["attend_spans"] = spans
        return request


class ImageMarkError(ValueError):
    """The template dropped or repeated an image's marker."""


def image_prompt(text: str, images: dict[int, Image.Image], family: VisionFamily, tokenizer: Any,
                 key: Any) -> ImagePrompt:
    """`text` (a rendered prompt holding `image_mark(i)` for each image i of `images`) as token ids: each marker
    replaced by the family's tokens for that image. `key(digest) -> bytes` makes an image's key from its pixel
    digest."""
    ids: list[int] = []
    placed: list[PlacedImage] = []
    seen: set[int] = set()
    pos = 0
    for m in _MARK.finditer(text):
        i = int(m.group(1))
        if i not in images or i in seen:
            raise ImageMarkError(f"image marker {i} is not one of the request's {len(images)} images")
        seen.add(i)
        ids += tokenizer.encode(text[pos:m.start()], add_special_tokens=False)
        prepared = family.preprocess(images[i])
        tokens, offset = family.prompt_tokens(prepared, tokenizer)
        runs = placeholder_runs(tokens, offset, len(ids))
        if sum(n for _, n in runs) != prepared.num_tokens:
            raise ValueError(f"{family.projector_type}: {sum(n for _, n in runs)} placeholders for "
                             f"{prepared.num_tokens} embedding rows")
        placed.append(PlacedImage(runs, prepared, key(image_digest(images[i]))))
        ids += tokens
        pos = m.end()
    ids += tokenizer.encode(text[pos:], add_special_tokens=False)
    if len(seen) != len(images):
        raise ImageMarkError(f"the chat template dropped {len(images) - len(seen)} of the request's images")
    return ImagePrompt(ids, placed)
