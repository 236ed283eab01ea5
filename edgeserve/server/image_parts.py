"""Image parts of every API's messages, checked for shape and kept as sent: an `ImageInput` each, whose text
marker stands in the message content where the image was. The pipeline decodes them (off the event loop, under
the server's limits) when it builds the prompt (edgeserve/server/image_input.py)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from edgeserve.server.errors import bad_request
from edgeserve.vision.prompt import image_mark

# the content part types that carry an image: OpenAI chat, Responses, Anthropic
IMAGE_PART_TYPES = ("image_url", "input_image", "image")
_ids = itertools.count()


@dataclass
class ImageInput:
    """One image as a request sent it: a data URL, base64 text or an http(s) URL, and the field it came in."""

    data: str
    field: str
    number: int = -1  # process-wide; its marker, the text that stands for it in its message, is image_mark(number)

    def __post_init__(self) -> None:
        if self.number < 0:
            self.number = next(_ids)

    @property
    def mark(self) -> str:
        return image_mark(self.number)


def image_part(part: dict, here: str) -> ImageInput:
    """An image content part: OpenAI `{"type": "image_url", "image_url": {"url"}}`, Responses
    `{"type": "input_image", "image_url"}`, Anthropic `{"type": "image", "source": {"type": "base64", "data"}}`
    (or a url source); a malformed one is a 400 naming its field."""
    kind = part.get("type")
    if kind == "image_url":
        value = part.get("image_url")
        url = value.get("url") if isinstance(value, dict) else value
        return _url(url, f"{here}.image_url.url" if isinstance(value, dict) else f"{here}.image_url")
    if kind == "input_image":
        if part.get("file_id") is not None and part.get("image_url") is None:
            raise bad_request(f"{here}.file_id: file ids are not supported; send image_url as a data URL",
                              f"{here}.file_id")
        return _url(part.get("image_url"), f"{here}.image_url")
    source = part.get("source")
    if not isinstance(source, dict) or source.get("type") not in ("base64", "url"):
        raise bad_request(f"{here}.source must be an object with type base64 or url", f"{here}.source")
    if source["type"] == "url":
        return _url(source.get("url"), f"{here}.source.url")
    data = source.get("data")
    if not isinstance(data, str) or not data:
        raise bad_request(f"{here}.source.data must be base64 image data", f"{here}.source.data")
    return ImageInput(data, f"{here}.source.data")


def base64_images(value: Any, here: str) -> list[ImageInput]:
    """Ollama's `images`: a list of base64 strings."""
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise bad_request(f"{here} must be a list of base64-encoded images", here)
    return [ImageInput(v, f"{here}[{i}]") for i, v in enumerate(value)]


def _url(url: Any, field: str) -> ImageInput:
    if not isinstance(url, str) or not url.startswith(("data:", "http://", "https://")):
        raise bad_request(f"{field} must be a data URL (data:image/png;base64,...) or an http(s) URL", field)
    return ImageInput(url, field)


def message_images(messages: list[dict[str, Any]] | None) -> list[ImageInput]:
    """Every image of a request's chat messages, in message order."""
    return [img for m in messages or () for img in m.get("images", ())]
