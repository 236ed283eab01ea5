"""Gemma 4 image input (edgeserve/vision/gemma4.py): preprocessing against transformers' Gemma4ImageProcessorPil,
and the encoder's LM rows against transformers' get_image_features, from the HF folder and from the `gemma4v` mmproj
llama.cpp's converter writes of it (`--mmproj`); a tiny random tower with clipped linears and standardization."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from converter_parity import convert
from vision_helpers import byte_tokenizer, picture

from edgeserve.vision.family import load_vision

transformers = pytest.importorskip("transformers")

SLIDING, FULL = "sliding_attention", "full_attention"
TEXT = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1, eos_token_id=2, intermediate_size=96, head_dim=16,
            global_head_dim=32, sliding_window=5, num_hidden_layers=2, layer_types=[SLIDING, FULL],
            hidden_size_per_layer_input=8, num_kv_shared_layers=0)
# 4-pixel patches pooled 3 x 3 (llama.cpp's gemma4v pooling, which its mmproj does not store), 4 heads of 16
VISION = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
              head_dim=16, patch_size=4, pooling_kernel_size=3, position_embedding_size=64, standardize=True,
              use_clipped_linears=True)
MAX_SOFT_TOKENS = 70
MODEL = "gemma4v"


def _randomize(model) -> None:
    """Weights far from their init; clip bounds that bite (the inputs of the q projections, the outputs of the MLP's
    down projections)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) * 0.15)
        for name, b in model.named_buffers():
            if name.endswith(("std_bias", "std_scale")):
                b.copy_(torch.randn_like(b) * 0.3 + (1.0 if "scale" in name else 0.0))
            elif "q_proj.input_" in name:
                b.fill_(1.5 if name.endswith("max") else -1.5)
            elif "down_proj.output_" in name:
                b.fill_(0.5 if name.endswith("max") else -0.5)


SPECIALS = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|image>", "<|image|>", "<image|>"]
# Gemma 4's turn markers and its image part (`<|image|>`, which the processor expands): the plumbing, not Google's text
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
            "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
            "{% if p.type == 'image' %}<|image|>{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}<turn|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}")


def tiny_gemma4v(out: Path, **text) -> Path:
    """A tiny random Gemma4ForConditionalGeneration (an E model's text with per-layer inputs, and the vision tower;
    `text`: text config overrides) with its image processor's config and a byte-level tokenizer holding Gemma 4's
    image tokens, as saved."""
    out.mkdir(parents=True, exist_ok=True)
    vocab = byte_tokenizer(out, SPECIALS, TEMPLATE, "<bos>", "<turn|>")
    cfg = transformers.Gemma4Config(
        text_config=dict(TEXT, vocab_size=len(vocab), vocab_size_per_layer_input=len(vocab), **text), vision_config=VISION,
        audio_config=None, boi_token_id=vocab["<|image>"], image_token_id=vocab["<|image|>"],
        eoi_token_id=vocab["<image|>"])
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Gemma4ForConditionalGeneration(cfg).float().eval()
    _randomize(model)
    model.save_pretrained(out)
    transformers.Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=3,
                                         max_soft_tokens=MAX_SOFT_TOKENS).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tiny_gemma4v(tmp_path_factory.mktemp("m") / MODEL)


@pytest.fixture(scope="module")
def hf_model(folder):
    return transformers.Gemma4ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def mmproj(folder, tmp_path_factory) -> Path:
    return convert(folder, tmp_path_factory.mktemp("mmproj") / "mmproj.gguf", "--mmproj")


def _image(width: int, height: int, seed: int, fmt: str = "PNG") -> Image.Image:
    return Image.open(io.BytesIO(picture(width, height, seed=seed, fmt=fmt))).convert("RGB")


def _hf_rows(hf_model, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """transformers' LM rows for one image's patches (row-major, as the processor makes them)."""
    rows, cols = grid
    positions = torch.stack([torch.arange(cols).repeat(rows), torch.arange(rows).repeat_interleave(cols)], -1)
    with torch.no_grad():
        out = hf_model.model.get_image_features(pixel_values=patches[None], image_position_ids=positions[None])
    return torch.cat(list(out.pooler_output)) if isinstance(out.pooler_output, (list, tuple)) else out.pooler_output


@pytest.mark.parametrize("size,fmt", [((37, 53), "PNG"), ((129, 31), "JPEG"), ((64, 64), "PNG"), ((400, 9), "PNG")])
def test_preprocessing_matches_the_processor(folder, size, fmt):
    family = load_vision(folder, None)
    img = _image(*size, seed=sum(size), fmt=fmt)
    want = transformers.Gemma4ImageProcessorPil.from_pretrained(folder)(images=img, return_tensors="pt")
    got = family.preprocess(img)
    n = got.pixel_values.shape[0]
    assert got.num_tokens == int(want["num_soft_tokens_per_image"][0]) and got.num_tokens <= MAX_SOFT_TOKENS
    torch.testing.assert_close(got.pixel_values, want["pixel_values"][0, :n], atol=1e-6, rtol=0)
    assert (want["image_position_ids"][0, n:] == -1).all()  # the rest is the processor's padding


@pytest.mark.parametrize("form", ["folder", "mmproj"])
def test_image_rows_match_transformers(form, folder, mmproj, hf_model):
    family = load_vision(folder if form == "folder" else mmproj, hf_model.config.text_config)
    assert family.projector_type == "gemma4v"
    family.max_tokens = MAX_SOFT_TOKENS  # the mmproj's budget is the processor's default (280): too wide a grid for
    # this tiny tower's 64-row position tables
    for size in ((50, 41), (23, 90)):
        prepared = family.preprocess(_image(*size, seed=size[0]))
        got = family.encode([prepared])[0]
        want = _hf_rows(hf_model, prepared.pixel_values, prepared.grid)
        assert got.shape == (prepared.num_tokens, 64) and want.abs().max() > 0.5
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_clipped_linears_matter(folder, hf_model):
    family = load_vision(folder, hf_model.config.text_config)
    prepared = family.preprocess(_image(40, 40, seed=3))
    want = _hf_rows(hf_model, prepared.pixel_values, prepared.grid)
    for layer in family.tower.layers:
        layer["q"].bounds = None
    assert (family.encode([prepared])[0] - want).abs().max() > 1e-3


def test_mmproj_metadata_is_gemma4v(mmproj):
    from edgeserve.loaders.gguf_file import GGUFFile

    meta = GGUFFile(mmproj).metadata
    assert meta["clip.vision.projector_type"] == "gemma4v"
    assert json.dumps(meta.get("clip.vision.projector.scale_factor")) == "null"  # so the family's default pool is 3


def test_language_model_reads_the_image_rows_in_chunks(folder, hf_model):
    """The image's rows replace its placeholders' embeddings (an E model's per-layer inputs there: the padding
    token's), also when prefill chunks split the image: the logits are transformers' with the same pixels."""
    from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention
    from edgeserve.engine.runner.model_runner import image_rows
    from edgeserve.engine.sched.scheduler import ScheduledSeq
    from edgeserve.kernels.dispatch import AttentionMetadata
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    lm = load_model(resolve(str(folder)), dtype="float32", device="cpu")
    assert lm.config.per_layer_input_size == 8
    family = load_vision(folder, lm.config)
    prepared = family.preprocess(_image(30, 20, seed=5))
    image_ids, offset = family.prompt_tokens(prepared, lm.tokenizer)
    head = lm.tokenizer.encode("<bos>look:", add_special_tokens=False)
    ids = head + image_ids + lm.tokenizer.encode(" ok", add_special_tokens=False)
    start, rows = len(head) + offset, family.encode([prepared])[0]
    rows_, cols = prepared.grid
    positions = torch.stack([torch.arange(cols).repeat(rows_), torch.arange(rows_).repeat_interleave(cols)], -1)
    with torch.no_grad():
        want = hf_model(input_ids=torch.tensor([ids]), pixel_values=prepared.pixel_values[None],
                        image_position_ids=positions[None]).logits[0]
    blocks = list(range((len(ids) + 15) // 16))

    def run(chunk: int, images: tuple) -> torch.Tensor:
        pool, hidden = KVPool(lm.config, len(blocks), 16, lm.model.dtype, lm.model.device), []
        for lo in range(0, len(ids), chunk):
            hi = min(lo + chunk, len(ids))
            seq = ScheduledSeq(0, ids[lo:hi], list(range(lo, hi)), list(range(lo, hi)), blocks, hi,
                               hi == len(ids), images=images)
            meta = AttentionMetadata.build([hi - lo], [hi], [blocks], list(range(lo, hi)))
            hidden.append(lm.model.forward(torch.tensor(ids[lo:hi]), torch.arange(lo, hi),
                                           PagedKVAttention(pool, meta), image_rows=image_rows([seq], lm.model.device)))
        return lm.model.logits(torch.cat(hidden))

    torch.testing.assert_close(run(23, ((start, rows),)), want, atol=2e-4, rtol=2e-4)  # the image straddles chunks
    assert (run(len(ids), ())[-1] - want[-1]).abs().max() > 1e-2  # without the rows the logits after it differ


def test_image_tokens_attend_both_ways_on_the_sliding_layers(tmp_path):
    """`use_bidirectional_attention: vision` (the larger sizes): an image's tokens see each other both ways on the
    sliding layers (within the window behind them), causally on the global ones: the logits are transformers' with
    the processor's mm_token_type_ids, and differ from causal ones and from ones open both ways on every layer."""
    from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention
    from edgeserve.kernels.dispatch import AttentionMetadata
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    folder = tiny_gemma4v(tmp_path / MODEL, use_bidirectional_attention="vision")
    hf = transformers.Gemma4ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    lm = load_model(resolve(str(folder)), dtype="float32", device="cpu")
    family = load_vision(folder, lm.config)
    assert family.bidirectional_images
    prepared = family.preprocess(_image(20, 30, seed=7))
    image_ids, offset = family.prompt_tokens(prepared, lm.tokenizer)
    head = lm.tokenizer.encode("<bos>see", add_special_tokens=False)
    ids = head + image_ids + lm.tokenizer.encode(" then", add_special_tokens=False)
    start, n = len(head) + offset, prepared.num_tokens
    rows_, cols = prepared.grid
    positions = torch.stack([torch.arange(cols).repeat(rows_), torch.arange(rows_).repeat_interleave(cols)], -1)
    types = torch.zeros(1, len(ids), dtype=torch.long)
    types[0, start:start + n] = 1
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids]), pixel_values=prepared.pixel_values[None],
                  image_position_ids=positions[None], mm_token_type_ids=types).logits[0]
    blocks = list(range((len(ids) + 15) // 16))
    index = torch.arange(start, start + n)

    def logits(spans, every_layer: bool = False) -> torch.Tensor:
        meta = AttentionMetadata.build([len(ids)], [len(ids)], [blocks], list(range(len(ids))))
        meta.attend_spans = spans
        attn = PagedKVAttention(KVPool(lm.config, len(blocks), 16, lm.model.dtype, lm.model.device), meta)
        if every_layer:  # the global layers' spans too (Gemma 3's rule)
            attend = attn.attend
            attn.attend = lambda *a, spans=True, **kw: attend(*a, **kw)  # type: ignore[method-assign]
        hidden = lm.model.forward(torch.tensor(ids), torch.arange(len(ids)), attn,
                                  image_rows=(index, family.encode([prepared])[0]))
        return lm.model.logits(hidden)

    span = [((start, start + n),)]
    torch.testing.assert_close(logits(span), want, atol=2e-4, rtol=2e-4)
    assert (logits(None)[start:start + n] - want[start:start + n]).abs().max() > 1e-2
    assert (logits(span, every_layer=True)[start:start + n] - want[start:start + n]).abs().max() > 1e-2


def test_chat_image_api_and_prefix_cache(folder):
    """Through the server: each API's image form reaches the same rows; the same image again is answered the same
    from the encoder cache with its blocks from the prefix cache, another image with the same text shares none."""
    import httpx

    from edgeserve.engine.config import EngineConfig
    from edgeserve.server import ServerConfig
    from server_helpers import metric, serve
    from vision_helpers import data_url

    red, blue = picture(40, 30, seed=1), picture(40, 30, seed=2)

    def chat(image: bytes) -> dict:
        return {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": data_url(image)}}]}]}

    cfg = ServerConfig(engine=EngineConfig(kv_cache_gb=0.02, block_size=16), models=(str(folder),), keep_alive=None,
                       max_images=2, max_image_pixels=200 * 200)
    with serve(cfg) as s, httpx.Client(base_url=s.url, timeout=120) as c:
        assert c.post("/v1/chat/completions", json=chat(red)).status_code == 200
        engine, calls = s.manager.entries[MODEL].engine, []
        submit = engine.submit
        engine.submit = lambda ids, params, request_id=None, **kw: (calls.append({"ids": list(ids), **kw}),
                                                                    submit(ids, params, request_id, **kw))[1]
        hits = metric(c.get("/metrics").text, "edgeserve_image_encoder_cache_hits_total", f'model="{MODEL}"') or 0
        again = c.post("/v1/chat/completions", json=chat(red)).json()
        start, rows = calls[-1]["images"][0]
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= (start + rows.shape[0]) // 16 * 16 > start  # the image's whole blocks came cached
        assert metric(c.get("/metrics").text, "edgeserve_image_encoder_cache_hits_total",
                      f'model="{MODEL}"') == hits + 1
        b64 = base64.b64encode(blue).decode()
        for path, body in [
                ("/v1/chat/completions", chat(blue)),
                ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
                    {"type": "text", "text": "hi"}]}]}),
                ("/api/chat", {"model": MODEL, "stream": False, "options": {"num_predict": 4},
                               "messages": [{"role": "user", "content": "hi", "images": [b64]}]})]:
            assert c.post(path, json=body).status_code == 200, path
        red_call, blue_call = calls[0], calls[1]
        assert blue_call["ids"] == red_call["ids"]  # the same tokens: only the image tells them apart
        assert blue_call["prefix_key"] != red_call["prefix_key"]
        assert (blue_call["images"][0][1] - rows).abs().max() > 1e-3  # another image, other rows
        assert len(calls) == 4 and all(torch.equal(call["images"][0][1], blue_call["images"][0][1])
                                       for call in calls[2:])


def test_f16_mmproj_encodes_to_float16_rounding(folder, hf_model, tmp_path):
    """The converter's default file (F16 matrices, F32 position tables) encodes as transformers to float16
    rounding."""
    family = load_vision(convert(folder, tmp_path / "mmproj-f16.gguf", "--mmproj", outtype="f16"),
                         hf_model.config.text_config)
    family.max_tokens = MAX_SOFT_TOKENS
    prepared = family.preprocess(_image(33, 45, seed=9))
    want = _hf_rows(hf_model, prepared.pixel_values, prepared.grid)
    assert (family.encode([prepared])[0] - want).abs().max().item() < 2e-2 * max(1.0, want.abs().max().item())
