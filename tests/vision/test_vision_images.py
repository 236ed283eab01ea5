"""Image decoding and limits (edgeserve/vision/images.py) and the prompt placement of image markers."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from edgeserve.vision.images import (ImageError, ImageLimits, decode_base64, decode_data_url, decode_image,
                                     image_digest)
from vision_helpers import data_url, picture


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_each_format_decodes_to_rgb(fmt):
    img = decode_image(picture(23, 17, seed=1, fmt=fmt), "f")
    assert img.mode == "RGB" and img.size == (23, 17)


def test_a_gif_gives_its_first_frame():
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    assert decode_image(buf.getvalue(), "f").getpixel((0, 0)) == (255, 0, 0)


def test_transparency_is_composed_over_white():
    buf = io.BytesIO()
    Image.new("RGBA", (4, 4), (0, 0, 0, 0)).save(buf, format="PNG")
    assert decode_image(buf.getvalue(), "f").getpixel((1, 1)) == (255, 255, 255)


def test_the_digest_is_of_the_pixels_not_the_encoding():
    png, same = picture(20, 20, seed=4), decode_image(picture(20, 20, seed=4, fmt="WEBP"), "f")
    assert image_digest(decode_image(png, "f")) == image_digest(decode_image(png, "g"))
    lossless = io.BytesIO()
    decode_image(png, "f").save(lossless, format="WEBP", lossless=True)
    assert image_digest(decode_image(lossless.getvalue(), "f")) == image_digest(decode_image(png, "f"))
    assert image_digest(same) != image_digest(decode_image(picture(20, 20, seed=5), "f"))


@pytest.mark.parametrize("call,limit", [
    (lambda: decode_image(b"no image here", "messages[0].content[1]"), "decodable"),
    (lambda: decode_image(picture(50, 50, seed=1), "messages[0].content[1]", ImageLimits(max_pixels=49 * 50)),
     "2450 pixels"),
    (lambda: decode_image(picture(50, 50, seed=1), "messages[0].content[1]", ImageLimits(max_bytes=100)),
     "100 bytes"),
    (lambda: decode_base64("@@@", "messages[0].content[1]"), "decodable"),
    (lambda: decode_data_url("data:image/png,abc", "messages[0].content[1]"), "data URL"),
])
def test_errors_name_the_field_and_the_limit(call, limit):
    with pytest.raises(ImageError) as e:
        call()
    assert e.value.field == "messages[0].content[1]" and limit in str(e.value)
    assert "BytesIO" not in str(e.value)


def test_base64_and_data_urls_give_the_same_pixels():
    data = picture(9, 7, seed=2)
    a = decode_base64(base64.b64encode(data).decode(), "f")
    b = decode_data_url(data_url(data), "f")
    assert image_digest(a) == image_digest(b)


@pytest.fixture(scope="module")
def image_host():
    """A local HTTP server: /cat.png (a picture), /big.png (over a small limit), /missing.png (404)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    files = {"/cat.png": picture(20, 10, seed=11), "/big.png": picture(300, 300, seed=12)}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            data = files.get(self.path)
            self.send_response(200 if data else 404)
            self.send_header("Content-Length", str(len(data or b"")))
            self.end_headers()
            self.wfile.write(data or b"")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", files
    server.shutdown()


def test_image_urls_are_fetched_only_when_allowed_and_within_the_limits(image_host):
    from types import SimpleNamespace

    from edgeserve.server.errors import APIError
    from edgeserve.server.image_input import decode_inputs
    from edgeserve.server.image_parts import ImageInput

    base, files = image_host
    config = SimpleNamespace(max_images=4, max_image_pixels=10**6, max_body_bytes=10**6, allow_image_urls=True)
    cat = ImageInput(f"{base}/cat.png", "messages[0].content[1].image_url.url")
    got = decode_inputs([cat], object(), "m", config)[cat.number]
    assert image_digest(got) == image_digest(decode_image(files["/cat.png"], "f"))
    for name, limit, message in (("missing.png", 10**6, "HTTP 404"), ("big.png", 1000, "1000 bytes")):
        bad = ImageInput(f"{base}/{name}", "messages[0].content[0].image_url.url")
        with pytest.raises(APIError) as e:
            decode_inputs([bad], object(), "m", SimpleNamespace(**{**vars(config), "max_body_bytes": limit}))
        assert e.value.status == 400 and e.value.param == bad.field and message in e.value.message
    with pytest.raises(APIError) as e:  # not fetched without --allow-image-urls
        decode_inputs([cat], object(), "m", SimpleNamespace(**{**vars(config), "allow_image_urls": False}))
    assert e.value.param == cat.field and "--allow-image-urls" in e.value.message
