"""Qwen2.5-VL / Qwen3-VL vision family (issue 35): preprocessing, the towers and mergers (Qwen3-VL's DeepStack
features too) against transformers in float32, from safetensors and from an mmproj GGUF written here."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from edgeserve.errors import ModelLoadError
from edgeserve.vision.family import load_vision
from edgeserve.vision.images import decode_image

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402

from edgeserve.bench.random_mmproj import write_qwen_mmproj  # noqa: E402

TEXT = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=300, max_position_embeddings=512, rope_theta=10000.0)
VISION = {
    "qwen25": dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=32, patch_size=14,
                   window_size=56, fullatt_block_indexes=[1, 3]),
    "qwen3": dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=32, patch_size=16,
                  num_position_embeddings=16, deepstack_visual_indexes=[0, 2]),
}
# small pixel ranges keep the grids tiny while still spanning several Qwen2.5-VL windows
PIXELS = {"qwen25": (28 * 28 * 4, 28 * 28 * 60), "qwen3": (32 * 32 * 4, 32 * 32 * 40)}


def tiny_model(kind: str):
    """A random tiny Qwen2.5-VL / Qwen3-VL (float32, eager attention), weights spread wide enough to matter."""
    torch.manual_seed(0)
    if kind == "qwen25":
        cfg = transformers.Qwen2_5_VLConfig(
            vision_config=VISION[kind], text_config=dict(TEXT, rope_scaling={"type": "mrope",
                                                                             "mrope_section": [2, 3, 3]}),
            image_token_id=297, vision_start_token_id=298, vision_end_token_id=299)
        model = transformers.Qwen2_5_VLForConditionalGeneration(cfg)
    else:
        cfg = transformers.Qwen3VLConfig(
            vision_config=VISION[kind], text_config=dict(TEXT, head_dim=16, rope_scaling={
                "rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
            image_token_id=297, vision_start_token_id=298, vision_end_token_id=299)
        model = transformers.Qwen3VLForConditionalGeneration(cfg)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15)
    return model.float().eval()


def processor(kind: str) -> Qwen2VLImageProcessorPil:
    """transformers' processor with the model's settings (Qwen3-VL: patch 16, mean and std 0.5) and the test's
    pixel range."""
    lo, hi = PIXELS[kind]
    extra = dict(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3) if kind == "qwen3" else {}
    return Qwen2VLImageProcessorPil(min_pixels=lo, max_pixels=hi, **extra)


def save_folder(kind: str, model, tmp_path):
    """The model as an HF folder (config.json, safetensors, preprocessor_config.json with the test's pixel range)."""
    folder = tmp_path / kind
    model.save_pretrained(folder)
    processor(kind).save_pretrained(folder)
    return folder


def odd_image(width: int, height: int, fmt: str, seed: int = 0) -> Image.Image:
    """A smooth-plus-noise RGB picture of an odd size, encoded as `fmt` and decoded as a request's image is."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx * 255 / width, yy * 255 / height, (xx + yy) % 255], -1)
    arr = np.clip(base + rng.normal(0, 30, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return decode_image(buf.getvalue(), "image")


def reference(model, kind: str, image: Image.Image):
    """transformers' processor output and the tower's rows (DeepStack features after them for Qwen3-VL)."""
    out = processor(kind)(images=[image], return_tensors="pt")
    with torch.no_grad():
        r = model.model.visual(out["pixel_values"], grid_thw=out["image_grid_thw"])
    rows = r.pooler_output
    if kind == "qwen3":
        rows = torch.cat([rows, *r.deepstack_features], dim=-1)
    return out, rows


@pytest.fixture(scope="module", params=["qwen25", "qwen3"])
def tiny(request, tmp_path_factory):
    kind = request.param
    model = tiny_model(kind)
    return kind, model, save_folder(kind, model, tmp_path_factory.mktemp("qwenvl"))


@pytest.mark.parametrize("size,fmt", [((131, 75), "PNG"), ((57, 123), "JPEG"), ((300, 41), "PNG")])
def test_preprocessing_matches_transformers(tiny, size, fmt):
    kind, model, folder = tiny
    family = load_vision(folder, None)
    image = odd_image(*size, fmt)
    ours = family.preprocess(image)
    out = processor(kind)(images=[image], return_tensors="pt")
    assert list(ours.grid) == out["image_grid_thw"][0].tolist()
    pv = out["pixel_values"]
    p = 16 if kind == "qwen3" else 14
    frames = pv.view(pv.shape[0], 3, 2, p * p)
    assert torch.equal(frames[:, :, 0], frames[:, :, 1])  # an image is two equal frames; we keep one
    torch.testing.assert_close(ours.pixel_values, frames[:, :, 0].reshape(pv.shape[0], -1), atol=1e-6, rtol=0)
    assert ours.num_tokens == pv.shape[0] // 4


def test_tower_from_safetensors_matches_transformers(tiny):
    kind, model, folder = tiny
    family = load_vision(folder, model.config.text_config)
    image = odd_image(131, 75, "PNG", seed=1)
    _, want = reference(model, kind, image)
    (got,) = family.encode([family.preprocess(image)])
    width = 32 * (3 if kind == "qwen3" else 1)  # Qwen3-VL: main rows + two DeepStack layers' features
    assert got.shape == want.shape == (want.shape[0], width)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("matrix_type", ["F32", "F16"])
def test_tower_from_mmproj_gguf_matches_transformers(tiny, tmp_path, matrix_type):
    kind, model, _ = tiny
    mean, std = ((0.5,) * 3, (0.5,) * 3) if kind == "qwen3" else (None, None)
    path = write_qwen_mmproj(tmp_path / "mmproj.gguf", VISION[kind], model.state_dict(), qwen3=kind == "qwen3",
                             matrix_type=matrix_type, image_mean=mean, image_std=std)
    family = load_vision(path, model.config.text_config)
    assert family.projector_type == ("qwen3vl_merger" if kind == "qwen3" else "qwen2.5vl_merger")
    lo, hi = PIXELS[kind]
    family.cfg.min_pixels, family.cfg.max_pixels = lo, hi  # the mmproj's default limits are llama.cpp's
    image = odd_image(75, 131, "PNG", seed=2)
    _, want = reference(model, kind, image)
    (got,) = family.encode([family.preprocess(image)])
    tol = 2e-5 if matrix_type == "F32" else 3e-2  # F16 weights: half-precision rounding of every matrix
    torch.testing.assert_close(got, want, atol=tol * max(1.0, float(want.abs().max())), rtol=tol)


def test_window_attention_matters(tiny):
    """Qwen2.5-VL's windowed layers differ from full attention on an image wider than one window (so the window
    test above is not vacuous)."""
    kind, model, folder = tiny
    if kind != "qwen25":
        pytest.skip("Qwen2.5-VL only")
    family = load_vision(folder, None)
    prepared = family.preprocess(odd_image(131, 75, "PNG"))
    windowed = family.encode([prepared])[0]
    family.cfg.window = 0
    try:
        full = family.encode([prepared])[0]
    finally:
        family.cfg.window = VISION["qwen25"]["window_size"]
    assert (windowed - full).abs().max() > 1e-3


def test_prompt_tokens_and_width_check(tiny):
    kind, model, folder = tiny
    family = load_vision(folder, None)
    prepared = family.preprocess(odd_image(131, 75, "PNG"))
    vocab = {"<|vision_start|>": 298, "<|image_pad|>": 297, "<|vision_end|>": 299}

    class Tok:
        def token_to_id(self, t):
            return vocab.get(t)

    ids, offset = family.prompt_tokens(prepared, Tok())
    assert ids == [298] + [297] * prepared.num_tokens + [299] and offset == 1
    grid = family.mrope_grid(prepared)
    assert grid[0] * grid[1] * grid[2] == prepared.num_tokens
    with pytest.raises(ModelLoadError, match="vision_start"):
        family.prompt_tokens(prepared, type("T", (), {"token_to_id": lambda self, t: None})())

    class Narrow:
        hidden_size = 64

    with pytest.raises(ModelLoadError, match="64 wide"):
        load_vision(folder, Narrow())


def test_a_q8_0_mmproj_runs_on_the_native_kernels_in_bf16(tiny, tmp_path):
    """A Q8_0 mmproj loaded for a bf16 model keeps its matrices as GGUF blocks (the native CPU kernels) and still
    gives transformers' rows within bf16 / Q8_0 rounding."""
    from edgeserve.kernels.cpu.native import BlockWeight, library

    kind, model, _ = tiny
    if library() is None:
        pytest.skip("native CPU kernels not built")
    mean, std = ((0.5,) * 3, (0.5,) * 3) if kind == "qwen3" else (None, None)
    path = write_qwen_mmproj(tmp_path / "mmproj-q8.gguf", VISION[kind], model.state_dict(), qwen3=kind == "qwen3",
                             matrix_type="Q8_0", image_mean=mean, image_std=std)
    family = load_vision(path, model.config.text_config, dtype=torch.bfloat16)
    assert isinstance(family.tower.vit.weights.layers[0].qkv, BlockWeight)
    lo, hi = PIXELS[kind]
    family.cfg.min_pixels, family.cfg.max_pixels = lo, hi
    image = odd_image(75, 131, "PNG", seed=2)
    _, want = reference(model, kind, image)
    (got,) = family.encode([family.preprocess(image)])
    rel = float((got.float() - want).norm() / want.norm())
    assert rel < 0.05, rel
