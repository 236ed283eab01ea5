"""Images as requests carry them (data URLs, base64) decoded to RGB Pillow images, checked against the limits."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import warnings
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


class ImageError(ValueError):
    """An image that cannot be taken: undecodable, over a limit. `field` names the request field it came from."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ImageLimits:
    """What one request may carry: images in all, pixels per image, encoded bytes per image."""

    max_images: int = 8
    max_pixels: int = 4096 * 4096
    max_bytes: int = 20 * 1024 * 1024


DEFAULT_LIMITS = ImageLimits()


def decode_image(data: bytes, field: str, limits: ImageLimits = DEFAULT_LIMITS) -> Image.Image:
    """The image in `data` (PNG, JPEG, WebP; a GIF's first frame) as an RGB Pillow image; an undecodable image or
    one over `limits` raises ImageError naming `field` and the limit."""
    if len(data) > limits.max_bytes:
        raise ImageError(f"{field}: the image is {len(data)} bytes, over the limit of {limits.max_bytes} bytes",
                         field)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=FORMATS)
            width, height = img.size
            if width * height > limits.max_pixels:
                raise ImageError(f"{field}: the image is {width}x{height} pixels, over the limit of "
                                 f"{limits.max_pixels} pixels", field)
            img.seek(0)  # a GIF's (or animated WebP's) first frame
            img.load()
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError(f"{field} is not a decodable image (PNG, JPEG, WebP or GIF)", field) from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombWarning, Image.DecompressionBombError) as e:
        raise ImageError(f"{field} is not a decodable image (PNG, JPEG, WebP or GIF): {e}", field) from None
    return rgb(img)


def rgb(img: Image.Image) -> Image.Image:
    """`img` in RGB; a transparent image is composed over white (as the families' processors expect no alpha)."""
    if img.mode == "RGB":
        return img
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def decode_base64(text: str, field: str, limits: ImageLimits = DEFAULT_LIMITS) -> Image.Image:
    """An image sent as base64 text (Ollama's `images`, Anthropic's base64 source); a data URL is taken too."""
    if text.startswith("data:"):
        return decode_data_url(text, field, limits)
    if len(text) > limits.max_bytes * 4 // 3 + 4:
        raise ImageError(f"{field}: the image is over the limit of {limits.max_bytes} bytes", field)
    try:
        data = base64.b64decode(text.strip(), validate=False)
    except (binascii.Error, ValueError):
        raise ImageError(f"{field} is not valid base64", field) from None
    return decode_image(data, field, limits)


def decode_data_url(url: str, field: str, limits: ImageLimits = DEFAULT_LIMITS) -> Image.Image:
    """An image sent as a `data:image/...;base64,...` URL."""
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:") or not head.endswith(";base64"):
        raise ImageError(f"{field} must be a data URL (data:image/png;base64,...)", field)
    return decode_base64(payload, field, limits)


def image_digest(img: Image.Image) -> bytes:
    """A digest of the decoded pixels (and size): the same picture sent as PNG or re-encoded losslessly keys the
    same; any changed pixel keys differently."""
    h = hashlib.sha256()
    h.update(f"{img.mode}:{img.width}x{img.height}:".encode())
    h.update(img.tobytes())
    return h.digest()


def check_count(count: int, field: str, limits: ImageLimits = DEFAULT_LIMITS) -> None:
    """Raise ImageError naming `field` when a request carries more than `limits.max_images` images."""
    if count > limits.max_images:
        raise ImageError(f"{field}: {count} images, over the limit of {limits.max_images} images per request", field)
