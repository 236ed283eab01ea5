"""A chat request's images through the pipeline: decoded under the server's limits, placed in the prompt, encoded
(through the model's encoder cache) into the rows and prefix-cache spans the engine request carries."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from PIL import Image

from edgeserve.server.errors import APIError, bad_request
from edgeserve.server.image_parts import ImageInput
from edgeserve.vision.images import ImageError, ImageLimits, decode_base64, decode_image
from edgeserve.vision.prompt import ImageMarkError, ImagePrompt, image_prompt

URL_TIMEOUT_S = 10.0


@dataclass
class RequestImages:
    """A request's images once placed and encoded: what the engine request carries."""

    prompt: ImagePrompt
    embeds: list[torch.Tensor]
    encode_seconds: float  # encoder time for this request (0 when every image was cached)
    decode_seconds: float  # decoding and preprocessing time
    request: dict[str, Any] = field(default_factory=dict)  # ImagePrompt.engine_request

    def engine_args(self) -> dict[str, Any]:
        """`prefix_key`, `images` (and a Qwen-VL prompt's `mrope`, a Gemma 3 prompt's `attend_spans`) for
        AsyncEngine.submit."""
        return self.request


def decode_inputs(inputs: list[ImageInput], vision: Any, model: str, config: Any) -> dict[int, Image.Image]:
    """The request's images decoded (400 naming the field for a text-only model, too many images, an image that
    does not decode or is over a limit, or an http(s) URL the server does not fetch)."""
    if vision is None:
        raise APIError(400, f"model {model!r} does not take images (it has no vision projector; for a GGUF model "
                       "give one with --mmproj)", "invalid_request_error", inputs[0].field, "model_not_supported")
    limits = ImageLimits(max_images=config.max_images, max_pixels=config.max_image_pixels,
                         max_bytes=min(config.max_body_bytes, ImageLimits().max_bytes))
    if len(inputs) > limits.max_images:
        field = inputs[limits.max_images].field
        raise bad_request(f"{field}: {len(inputs)} images, over the limit of {limits.max_images} images per "
                          "request", field)
    try:
        return {i.number: _decode(i, limits, config.allow_image_urls) for i in inputs}
    except ImageError as e:
        raise bad_request(str(e), e.field) from None


def _decode(image: ImageInput, limits: ImageLimits, allow_urls: bool) -> Image.Image:
    if not image.data.startswith(("http://", "https://")):
        return decode_base64(image.data, image.field, limits)
    if not allow_urls:
        raise ImageError(f"{image.field}: image URLs are not fetched (the server runs without --allow-image-urls); "
                         "send the image as a data URL", image.field)
    return decode_image(fetch_url(image.data, image.field, limits.max_bytes), image.field, limits)


def fetch_url(url: str, field: str, max_bytes: int) -> bytes:
    """An http(s) URL's body, at most `max_bytes`, within URL_TIMEOUT_S (ImageError naming `field` otherwise)."""
    import httpx

    deadline = time.monotonic() + URL_TIMEOUT_S
    try:
        with httpx.stream("GET", url, timeout=URL_TIMEOUT_S, follow_redirects=True) as r:
            if r.status_code != 200:
                raise ImageError(f"{field}: fetching the image URL answered HTTP {r.status_code}", field)
            data = bytearray()
            for chunk in r.iter_bytes():
                data += chunk
                if len(data) > max_bytes:
                    raise ImageError(f"{field}: the image at the URL is over the limit of {max_bytes} bytes", field)
                if time.monotonic() > deadline:
                    raise ImageError(f"{field}: fetching the image URL took over {URL_TIMEOUT_S:.0f} s", field)
            return bytes(data)
    except httpx.HTTPError as e:
        raise ImageError(f"{field}: the image URL could not be fetched: {e}", field) from None


def place_images(prompt: str, images: dict[int, Image.Image], vision: Any, tokenizer: Any,
                 field: str) -> ImagePrompt:
    """The rendered prompt's token ids with each image's tokens where its marker is."""
    try:
        return image_prompt(prompt, images, vision.family, tokenizer, vision.key)
    except ImageError as e:  # one the family's preprocessing refuses (e.g. Qwen-VL's aspect-ratio limit)
        raise bad_request(str(e), field) from None
    except ImageMarkError as e:
        raise bad_request(f"{e} (the model's chat template must render every message's content)", field) from None


def encode_images(placed: ImagePrompt, vision: Any, decode_seconds: float,
                  abandoned: Callable[[], bool] | None = None) -> RequestImages:
    """The placed images' embedding rows (encoder cache first); `abandoned()` true stops the encoder between
    images (vision.runtime.EncodeAbandoned)."""
    embeds, seconds = vision.embeddings([p.prepared for p in placed.images], [p.key for p in placed.images],
                                        abandoned)
    return RequestImages(placed, embeds, seconds, decode_seconds, placed.engine_request(vision.family, embeds))
