"""Gemma 4 12B image input (HF `gemma4_unified`, edgeserve/vision/gemma4_unified.py + gemma4_patch_embed.py): a tiny
random Gemma4UnifiedForConditionalGeneration (Gemma 4 12B's text layer kinds, `use_bidirectional_attention: vision`,
the encoder-free embedder) saved by transformers and converted by llama.cpp's convert_hf_to_gguf.py (the text GGUF,
and the `gemma4uv` mmproj with `--mmproj`). Its image rows equal transformers' get_image_features from the folder and
from the mmproj; the logits of a prompt with an image equal transformers' (the mask its generate() builds: an image's
tokens both ways on the sliding layers, causal on the global ones) from the folder and from the GGUF + mmproj; the
chat API's image form works through the server with the image keyed into the prefix cache; a wrong mmproj is refused
in one line. transformers' Gemma4UnifiedImageProcessor needs torchvision (not installed here): preprocessing is checked
against Gemma 4's PIL processor, whose layout at patch x kernel pixels and kernel 1 is the unified one's after its
3 x 3 merge."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from converter_cases import GEMMA4_UNIFIED
from converter_parity import convert, load_ours
from vision_helpers import picture

from edgeserve.errors import ModelLoadError
from edgeserve.vision.family import load_vision

transformers = pytest.importorskip("transformers")

MODEL = "gemma4uv"
PATCH, POOL, MAX_SOFT_TOKENS = 4, 3, 70  # 12-pixel merged patches
SPECIALS = ["<|turn>", "<turn|>", "<|image>", "<|image|>", "<image|>"]  # after Llama 2's 32000 SentencePiece pieces
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
            "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
            "{% if p.type == 'image' %}<|image|>{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}<turn|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}")


def _tokenizer(spm: Path, out: Path) -> dict[str, int]:
    """Llama 2's SentencePiece vocabulary (a tokenizer llama.cpp's Gemma 4 converter takes) with Gemma 4's turn and
    image tokens added, and a chat template with Gemma 4's image part."""
    import tokenizers

    for f in spm.iterdir():
        shutil.copy(f, out / f.name)
    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens(SPECIALS)
    tok.save(str(out / "tokenizer.json"))
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg.update(chat_template=TEMPLATE, eos_token="<turn|>", add_bos_token=False)
    cfg.pop("added_tokens_decoder", None)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return {t: tok.token_to_id(t) for t in SPECIALS}


def _randomize(model) -> None:
    """Weights far from their init (norm and LayerNorm scales around 1, their biases and the position table
    spread)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = name.endswith("weight") and ("norm" in name or "_ln" in name)
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if scale else torch.randn_like(p) * 0.15)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)


def tiny_gemma4_unified(out: Path, spm: Path) -> Path:
    """The tiny random model saved as its HF folder: Gemma 4 12B's text layer kinds (K = V global layers, KV-shared
    layers, a 5-token window), the embedder (4-pixel patches merged 3 x 3, a 32-row position table), a small audio
    projection (llama.cpp's converter requires one), the processor's config as transformers writes it."""
    out.mkdir(parents=True, exist_ok=True)
    ids = _tokenizer(spm, out)
    cfg = transformers.Gemma4UnifiedConfig(
        text_config=dict(GEMMA4_UNIFIED, vocab_size=32000 + len(SPECIALS), use_bidirectional_attention="vision",
                         max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=ids["<turn|>"]),
        vision_config=dict(patch_size=PATCH, pooling_kernel_size=POOL, mm_embed_dim=48, mm_posemb_size=32,
                           output_proj_dims=48),
        audio_config=dict(audio_embed_dim=16, output_proj_dims=16), boi_token_id=ids["<|image>"],
        image_token_id=ids["<|image|>"], eoi_token_id=ids["<image|>"])
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Gemma4UnifiedForConditionalGeneration(cfg).float().eval()
    _randomize(model)
    model.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config["text_config"]["moe_intermediate_size"] = None  # llama.cpp's Gemma 4 converter reads it unconditionally
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(dict(
        image_processor_type="Gemma4UnifiedImageProcessor", image_mean=[0.0] * 3, image_std=[1.0] * 3,
        do_normalize=False, rescale_factor=1 / 255, patch_size=PATCH, pooling_kernel_size=POOL,
        max_soft_tokens=MAX_SOFT_TOKENS)))
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tokenizer_dirs) -> Path:
    return tiny_gemma4_unified(tmp_path_factory.mktemp("m") / MODEL, tokenizer_dirs("spm"))


@pytest.fixture(scope="module")
def hf_model(folder):
    model = transformers.Gemma4UnifiedForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    model.config._attn_implementation = "eager"
    return model.eval()


@pytest.fixture(scope="module")
def converted(folder, tmp_path_factory) -> tuple[Path, Path]:
    """(text GGUF, mmproj GGUF) as llama.cpp's converter writes them (f32)."""
    out = tmp_path_factory.mktemp("gguf")
    return convert(folder, out / "model.gguf"), convert(folder, out / "mmproj.gguf", "--mmproj")


def _image(width: int, height: int, seed: int) -> Image.Image:
    return Image.open(io.BytesIO(picture(width, height, seed=seed))).convert("RGB")


def _positions(grid: tuple[int, int]) -> torch.Tensor:
    """The processor's image_position_ids: (column, row) of each merged patch, row-major."""
    rows, cols = grid
    return torch.stack([torch.arange(cols).repeat(rows), torch.arange(rows).repeat_interleave(cols)], -1)


def _hf_rows(hf_model, prepared) -> torch.Tensor:
    with torch.no_grad():
        out = hf_model.model.get_image_features(pixel_values=prepared.pixel_values[None],
                                                image_position_ids=_positions(prepared.grid)[None])
    return torch.cat(list(out.pooler_output))


@pytest.mark.parametrize("size", [(37, 53), (129, 31), (60, 60), (400, 9)])
def test_preprocessing_is_gemma4_s_at_merged_patches(folder, size):
    """The merged patches are Gemma 4's PIL processor's patches of patch x kernel pixels (kernel 1: one token per
    patch), with the unified processor's token count (its 3 x 3 merge)."""
    family = load_vision(folder, None)
    img = _image(*size, seed=sum(size))
    processor = transformers.Gemma4ImageProcessorPil(patch_size=PATCH * POOL, pooling_kernel_size=1,
                                                     max_soft_tokens=MAX_SOFT_TOKENS)
    want = processor(images=img, return_tensors="pt")
    got = family.preprocess(img)
    n = got.num_tokens
    assert n == int(want["num_soft_tokens_per_image"][0]) and 0 < n <= MAX_SOFT_TOKENS
    assert got.pixel_values.shape == (n, (PATCH * POOL) ** 2 * 3)
    torch.testing.assert_close(got.pixel_values, want["pixel_values"][0, :n], atol=1e-6, rtol=0)
    assert torch.equal(_positions(got.grid), want["image_position_ids"][0, :n])


@pytest.mark.parametrize("form", ["folder", "mmproj"])
def test_image_rows_match_transformers(form, folder, converted, hf_model):
    family = load_vision(folder if form == "folder" else converted[1], hf_model.config.text_config)
    assert family.projector_type == "gemma4uv" and family.bidirectional_images
    family.max_tokens = MAX_SOFT_TOKENS  # an mmproj does not store the budget (280)
    for size in ((50, 41), (23, 90)):
        prepared = family.preprocess(_image(*size, seed=size[0]))
        got = family.encode([prepared])[0]
        want = _hf_rows(hf_model, prepared)
        assert got.shape == (prepared.num_tokens, 64) and want.abs().max() > 0.5
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_mmproj_pixel_columns_are_channel_major(converted, folder):
    """llama.cpp's converter stores the patch projection's columns channel-major: read as they are, the rows are
    wrong (the loader's permutation matters)."""
    from edgeserve.vision import gemma4_patch_embed

    family = load_vision(converted[1], None)
    family.max_tokens = MAX_SOFT_TOKENS
    prepared = family.preprocess(_image(40, 30, seed=2))
    want = family.encode([prepared])[0]
    order = gemma4_patch_embed._channel_major(PATCH * POOL)
    dense = family.embedder.dense
    family.embedder.dense = (dense[0][:, order], dense[1])
    assert (family.encode([prepared])[0] - want).abs().max() > 1e-2


def _prompt(lm, family, head: str, tail: str, seed: int):
    """Token ids of `head` + one image + `tail`, the image's [start, end) placeholder span, its prepared form."""
    prepared = family.preprocess(_image(26, 40, seed=seed))
    image_ids, offset = family.prompt_tokens(prepared, lm.tokenizer)
    ids = lm.tokenizer.encode(head, add_special_tokens=False)
    start = len(ids) + offset
    ids += image_ids + lm.tokenizer.encode(tail, add_special_tokens=False)
    return ids, (start, start + prepared.num_tokens), prepared


def _hf_logits(hf_model, ids: list[int], span: tuple[int, int], prepared, generate_mask: bool) -> torch.Tensor:
    """transformers' logits with the processor's mm_token_type_ids: under the masks its generate() builds for the
    prompt (`generate_mask`: both ways within the image on the sliding layers only, causal on the global ones), or
    under the generic masks its forward() builds from mm_token_type_ids alone."""
    input_ids = torch.tensor([ids])
    types = torch.zeros_like(input_ids)
    types[0, span[0]:span[1]] = 1
    kw: dict = {"mm_token_type_ids": types}
    if generate_mask:
        embeds = hf_model.get_input_embeddings()(input_ids)
        kw["attention_mask"] = hf_model.create_masks_for_generate(
            hf_model.config, embeds, None, None, torch.arange(len(ids))[None], mm_token_type_ids=types)
    with torch.no_grad():
        return hf_model(input_ids=input_ids, pixel_values=prepared.pixel_values[None],
                        image_position_ids=_positions(prepared.grid)[None], **kw).logits[0]


def _our_logits(lm, ids, span, rows, chunks: list[int], spans: bool = True, every_layer: bool = False):
    """Our logits over `ids` in prefill chunks of the given sizes over one paged pool, on the path the engine takes
    with an image's attend span (the per-op layers where the span is set)."""
    from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention
    from edgeserve.engine.runner.model_runner import image_rows
    from edgeserve.engine.sched.scheduler import ScheduledSeq
    from edgeserve.kernels.dispatch import AttentionMetadata

    blocks = list(range(-(-len(ids) // 16)))
    pool = KVPool(lm.config, len(blocks), 16, lm.model.dtype, lm.model.device)
    hidden, lo = [], 0
    for n in chunks:
        hi = lo + n
        attend = (span,) if spans else ()
        seq = ScheduledSeq(0, ids[lo:hi], list(range(lo, hi)), list(range(lo, hi)), blocks, hi, hi == len(ids),
                           images=((span[0], rows),), attend_spans=attend)
        meta = AttentionMetadata.build([n], [hi], [blocks], list(range(lo, hi)))
        meta.attend_spans = [attend] if attend and span[0] < hi and span[1] > lo else None
        attn = PagedKVAttention(pool, meta)
        if every_layer:  # the global layers' spans too (transformers' forward() from mm_token_type_ids)
            attend_fn = attn.attend
            attn.attend = lambda *a, spans=True, **kw: attend_fn(*a, **kw)  # type: ignore[method-assign]
        hidden.append(lm.model.forward(torch.tensor(ids[lo:hi]), torch.arange(lo, hi), attn,
                                       image_rows=image_rows([seq], lm.model.device)))
        lo = hi
    return lm.model.logits(torch.cat(hidden))


@pytest.mark.parametrize("form", ["folder", "gguf"])
def test_logits_with_an_image_equal_transformers(form, folder, converted, hf_model):
    """The HF folder, and the converted text GGUF with the `gemma4uv` mmproj: transformers' logits under its
    generate() masks, the image past the 5-token window, in one prefill and in chunks that never cut the image;
    causal image tokens, or image tokens both ways on the global layers too, give other logits."""
    lm = load_ours(folder if form == "folder" else converted[0])
    family = load_vision(folder if form == "folder" else converted[1], lm.config)
    family.max_tokens = MAX_SOFT_TOKENS
    assert family.bidirectional_images
    ids, span, prepared = _prompt(lm, family, "<s>look at this:", " ok, what is it?", seed=5)
    assert span[1] - span[0] > 5  # wider than the window
    want = _hf_logits(hf_model, ids, span, prepared, generate_mask=True)
    rows = family.encode([prepared])[0]
    torch.testing.assert_close(_our_logits(lm, ids, span, rows, [len(ids)]), want, atol=5e-4, rtol=5e-4)
    chunks = [span[0], span[1] - span[0], len(ids) - span[1]]  # as the scheduler's span_stop cuts them
    torch.testing.assert_close(_our_logits(lm, ids, span, rows, chunks), want, atol=5e-4, rtol=5e-4)
    image = slice(span[0], None)
    assert (_our_logits(lm, ids, span, rows, [len(ids)], spans=False)[image] - want[image]).abs().max() > 1e-2
    everywhere = _our_logits(lm, ids, span, rows, [len(ids)], every_layer=True)
    assert (everywhere[image] - want[image]).abs().max() > 1e-2
    if form == "folder":  # transformers' forward() given mm_token_type_ids alone builds other masks (generic ones,
        # the image open on every layer): generate() passes it the masks above, which the reference follows
        other = _hf_logits(hf_model, ids, span, prepared, generate_mask=False)
        assert (other[image] - want[image]).abs().max() > 1e-2


def _published_gemma3(folder: Path) -> Path:
    """A Gemma 3 folder with its tower under `vision_tower.vision_model.*`, the layout the converter maps."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    sd = load_file(path)
    save_file({("vision_tower.vision_model." + k[len("vision_tower."):] if k.startswith("vision_tower.") else k): v
               for k, v in sd.items()}, path, metadata={"format": "pt"})
    return folder


def test_wrong_mmproj_is_refused_in_one_line(converted, tmp_path):
    """A Gemma 3 mmproj given for this model (its image tokens are not in the vocabulary), a `gemma4uv` mmproj for
    another width of language model, Gemma 3's tensors read as this embedder: one ModelLoadError line each."""
    from types import SimpleNamespace

    from edgeserve.loaders.gguf_file import GGUFFile
    from edgeserve.vision.family import VisionSource
    from edgeserve.vision.gemma4_unified import Gemma4UnifiedVision
    from edgeserve.vision.runtime import load_runtime
    from vision_helpers import tiny_gemma3

    lm = load_ours(converted[0])
    gemma3 = convert(_published_gemma3(tiny_gemma3(tmp_path / "gemma3")), tmp_path / "mmproj-gemma3.gguf", "--mmproj")
    source = SimpleNamespace(kind="gguf", path=converted[0], name=MODEL)
    refusals = []
    for make in (lambda: load_runtime(source, lm, mmproj=gemma3),
                 lambda: load_vision(converted[1], SimpleNamespace(hidden_size=128)),
                 lambda: Gemma4UnifiedVision(VisionSource(gemma3, gguf=GGUFFile(gemma3)), lm.config)):
        with pytest.raises(ModelLoadError) as e:
            make()
        refusals.append(str(e.value))
    assert all("\n" not in r for r in refusals)
    assert "'<start_of_image>'" in refusals[0] and "maps to 64 wide rows, the language model is 128" in refusals[1]
    assert "not a Gemma 4 unified image embedder" in refusals[2]
    assert load_runtime(source, lm, mmproj=converted[1]).family.projector_type == "gemma4uv"


@pytest.mark.skipif(not __import__("edgeserve.kernels.cpu.native", fromlist=["available"]).available(),
                    reason="no native CPU kernels here")
def test_prefill_with_an_image_stays_on_the_per_op_path(folder, converted, caplog, monkeypatch, tmp_path):
    """The fused native stack (the converter's Q8_0 file) would open an image's span on every layer: a prefill with
    one runs per op (one log line says why, once), the same prompt without spans runs fused."""
    import logging

    from edgeserve.models.archs.gemma4 import model as gemma4_model

    monkeypatch.delenv("EDGESERVE_NATIVE", raising=False)
    monkeypatch.delenv("EDGESERVE_KERNELS", raising=False)
    lm = load_ours(convert(folder, tmp_path / "model-q8_0.gguf", outtype="q8_0"), dtype="bfloat16")
    native = lm.model.native_decoder()
    assert native is not None
    family = load_vision(converted[1], lm.config)
    family.max_tokens = 4  # an image within the 5-token window, as the 12B's 280 tokens are within its 1024
    ids, span, prepared = _prompt(lm, family, "<s>", " ok", seed=3)
    assert span[1] <= 5  # the span within the first window's keys: the fused stack's windows would be right
    rows = family.encode([prepared])[0]
    fused, real = [], native.forward
    native.forward = lambda *a, **kw: (fused.append(1), real(*a, **kw))[1]  # type: ignore[method-assign]
    gemma4_model._image_spans_run_per_op.cache_clear()
    with caplog.at_level(logging.INFO, logger="edgeserve.models"):
        for _ in range(2):
            _our_logits(lm, ids, span, rows, [len(ids)])
    assert not fused
    said = [r for r in caplog.records if "per-op path" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0].getMessage()
    _our_logits(lm, ids, span, rows, [len(ids)], spans=False)
    assert fused


@pytest.mark.parametrize("form", ["folder", "gguf"])
def test_chat_image_api_and_prefix_cache(form, folder, converted):
    """Through the server (the HF folder; the GGUF with the mmproj found beside it): each API's image form reaches
    the same rows, with the image's span sent to attend both ways; the same image again is answered from the encoder
    cache with its blocks from the prefix cache; another image with the same text shares its tokens, not its key."""
    import base64

    import httpx

    from edgeserve.engine.config import EngineConfig
    from edgeserve.server import ServerConfig
    from server_helpers import metric, serve
    from vision_helpers import data_url

    red, blue = picture(40, 30, seed=1), picture(40, 30, seed=2)
    path = folder if form == "folder" else converted[0]
    name = path.name if form == "folder" else path.stem

    def chat(image: bytes, name: str) -> dict:
        return {"model": name, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": data_url(image)}}]}]}

    cfg = ServerConfig(engine=EngineConfig(kv_cache_gb=0.05, block_size=16), models=(str(path),), keep_alive=None,
                       max_images=2, max_image_pixels=200 * 200)
    with serve(cfg) as s, httpx.Client(base_url=s.url, timeout=120) as c:
        first = c.post("/v1/chat/completions", json=chat(red, name))
        assert first.status_code == 200, first.text
        engine, calls = s.manager.entries[name].engine, []
        submit = engine.submit
        engine.submit = lambda ids, params, request_id=None, **kw: (calls.append({"ids": list(ids), **kw}),
                                                                    submit(ids, params, request_id, **kw))[1]
        label = f'model="{name}"'
        hits = metric(c.get("/metrics").text, "edgeserve_image_encoder_cache_hits_total", label) or 0
        again = c.post("/v1/chat/completions", json=chat(red, name)).json()
        start, rows = calls[-1]["images"][0]
        assert calls[-1]["attend_spans"] == [(start, start + rows.shape[0])]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= (start + rows.shape[0]) // 16 * 16 > start
        assert metric(c.get("/metrics").text, "edgeserve_image_encoder_cache_hits_total", label) == hits + 1
        b64 = base64.b64encode(blue).decode()
        for api, body in [
                ("/v1/chat/completions", chat(blue, name)),
                ("/v1/messages", {"model": name, "max_tokens": 4, "messages": [{"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
                    {"type": "text", "text": "hi"}]}]}),
                ("/api/chat", {"model": name, "stream": False, "options": {"num_predict": 4},
                               "messages": [{"role": "user", "content": "hi", "images": [b64]}]})]:
            assert c.post(api, json=body).status_code == 200, api
        red_call, blue_call = calls[0], calls[1]
        assert blue_call["ids"] == red_call["ids"] and blue_call["prefix_key"] != red_call["prefix_key"]
        assert (blue_call["images"][0][1] - rows).abs().max() > 1e-3
        assert len(calls) == 4 and all(torch.equal(call["images"][0][1], blue_call["images"][0][1])
                                       for call in calls[2:])


def test_a_text_only_checkpoint_has_no_vision(checkpoints):
    """Gemma 4 12B saved without its image embedder (`vision_config: null`) loads as text: no vision runtime."""
    from types import SimpleNamespace

    from edgeserve.vision.family import has_vision
    from edgeserve.vision.runtime import load_runtime

    _, text_folder, _ = checkpoints("gemma4-12b")
    assert json.loads((text_folder / "config.json").read_text())["vision_config"] is None
    assert not has_vision(text_folder)
    assert load_runtime(SimpleNamespace(kind="hf", path=text_folder, name="t"), None) is None
