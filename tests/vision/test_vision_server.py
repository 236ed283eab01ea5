"""Images through the server: every API's image form, the encoder cache and the prefix cache keyed by image, and
the 400s for images that cannot be taken."""

from __future__ import annotations

import base64

import httpx
import pytest
import torch

from edgeserve.engine.config import EngineConfig
from edgeserve.engine.cache.kv_blocks import block_hash
from edgeserve.server import ServerConfig
from server_helpers import metric, serve
from vision_helpers import data_url, picture, tiny_gemma3

pytest.importorskip("transformers")

MODEL = "gemma3v"
TEXT_MODEL = "SmolLM2-135M-Instruct.Q4_1"
RED, BLUE = picture(40, 30, seed=1), picture(40, 30, seed=2)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from edgeserve.registry import resolve

    folder = tiny_gemma3(tmp_path_factory.mktemp("m") / MODEL)
    text_model = str(resolve("smollm2-135m", pull_missing=False).path)
    cfg = ServerConfig(engine=EngineConfig(kv_cache_gb=0.02, block_size=16), models=(str(folder), text_model),
                       keep_alive=None, max_loaded_models=2, max_images=2, max_image_pixels=200 * 200)
    with serve(cfg) as s, httpx.Client(base_url=s.url, timeout=120) as c:
        r = c.post("/v1/chat/completions", json=_chat(RED))
        assert r.status_code == 200, r.text
        yield s, c, _record(s)


def _record(s) -> list[dict]:
    """Every engine submit of the vision model from now on: its ids, prefix key and image rows."""
    engine = s.manager.entries[MODEL].engine
    calls: list[dict] = []
    submit = engine.submit

    def recording(ids, params, request_id=None, **kw):
        calls.append({"ids": list(ids), **kw})
        return submit(ids, params, request_id, **kw)

    engine.submit = recording
    return calls


def _chat(image: bytes, text: str = "what is this?", **extra) -> dict:
    return {"model": MODEL, "max_tokens": 6, "temperature": 0, **extra, "messages": [{"role": "user", "content": [
        {"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": data_url(image)}}]}]}


def _b64(image: bytes) -> str:
    return base64.b64encode(image).decode()


def test_the_same_image_again_is_identical_and_a_cache_hit(server):
    s, c, calls = server
    before = metric(c.get("/metrics").text, "edgeserve_image_encoder_cache_hits_total", f'model="{MODEL}"') or 0
    r1, r2 = (c.post("/v1/chat/completions", json=_chat(RED)).json() for _ in range(2))
    assert "choices" in r1 and "choices" in r2, (r1, r2)
    assert r1["choices"][0]["message"]["content"] == r2["choices"][0]["message"]["content"]
    start = calls[-1]["images"][0][0]
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] >= start + 4  # the image's blocks came cached
    after = metric(c.get("/metrics").text, "edgeserve_image_encoder_cache_hits_total", f'model="{MODEL}"')
    assert after == before + 2  # neither request ran the encoder


def test_two_images_with_the_same_text_share_no_image_block(server):
    s, c, calls = server
    for image in (RED, BLUE):
        assert c.post("/v1/chat/completions", json=_chat(image, "tell")).status_code == 200
    a, b = calls[-2:]
    assert a["ids"] == b["ids"]  # the same tokens: only the image tells them apart
    (start, rows_a), (_, rows_b) = a["images"][0], b["images"][0]
    assert (rows_a - rows_b).abs().max() > 1e-3

    def hashes(call):
        out, parent, ids = [], b"", call["ids"]
        for i in range(len(ids) // 16):
            parent = block_hash(parent, ids[i * 16:(i + 1) * 16], call["prefix_key"].block_extra(i, 16))
            out.append(parent)
        return out

    first = start // 16
    ha, hb = hashes(a), hashes(b)
    assert ha[:first] == hb[:first] and len(ha) > first
    assert all(x != y for x, y in zip(ha[first:], hb[first:]))


def test_every_api_reaches_the_same_embeddings(server):
    s, c, calls = server
    n = len(calls)
    url = data_url(BLUE)
    bodies = [
        ("/v1/chat/completions", _chat(BLUE)),
        ("/v1/responses", {"model": MODEL, "max_output_tokens": 4, "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "hi"}, {"type": "input_image", "image_url": url}]}]}),
        ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _b64(BLUE)}},
            {"type": "text", "text": "hi"}]}]}),
        ("/api/chat", {"model": MODEL, "stream": False, "options": {"num_predict": 4},
                       "messages": [{"role": "user", "content": "hi", "images": [_b64(BLUE)]}]}),
        ("/api/generate", {"model": MODEL, "stream": False, "options": {"num_predict": 4}, "prompt": "hi",
                           "images": [_b64(BLUE)]}),
    ]
    for path, body in bodies:
        r = c.post(path, json=body)
        assert r.status_code == 200, (path, r.text)
    got = calls[n:]
    assert len(got) == len(bodies)
    for call in got:
        assert len(call["images"]) == 1 and torch.equal(call["images"][0][1], got[0]["images"][0][1])


@pytest.mark.parametrize("content,param", [
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64," + _b64(b"not a picture")}}],
     "messages[0].content[0].image_url.url"),
    ([{"type": "image_url", "image_url": {"url": data_url(RED)}}] * 3, "messages[0].content[2].image_url.url"),
    ([{"type": "image_url", "image_url": {"url": data_url(picture(300, 200, seed=3))}}],
     "messages[0].content[0].image_url.url"),
    ([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}],
     "messages[0].content[0].image_url.url"),
    ([{"type": "image_url", "image_url": {"url": "ftp://example.com/cat.png"}}],
     "messages[0].content[0].image_url.url"),
])
def test_images_that_cannot_be_taken_are_400s_naming_the_field(server, content, param):
    s, c, _ = server
    r = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                             "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_an_image_for_a_text_only_model_is_a_400(server):
    s, c, _ = server
    body = _chat(RED)
    body["model"] = TEXT_MODEL
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[1].image_url.url", r.text
    r = c.post("/api/chat", json={"model": TEXT_MODEL, "stream": False,
                                  "messages": [{"role": "user", "content": "hi", "images": ["AAAA"]}]})
    assert r.status_code == 400 and "images" in r.text


def test_show_lists_vision(server):
    s, c, _ = server
    caps = c.post("/api/show", json={"model": MODEL}).json()["capabilities"]
    assert "vision" in caps and "completion" in caps
    assert "vision" not in c.post("/api/show", json={"model": TEXT_MODEL}).json()["capabilities"]
