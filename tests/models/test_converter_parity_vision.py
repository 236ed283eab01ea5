"""Converter parity for vision towers (issue 54): a tiny random Gemma 3 vision-language model saved by transformers,
its tower and projector converted by llama.cpp's own convert_hf_to_gguf.py with `--mmproj` (the mmproj files people
download), loaded by edgeserve's vision loader, encodes images as transformers does: to float32 noise for an f32
file (against transformers with the projector's matrix rounded to float16, as the converter stores it in every
file), to float16 rounding for the converter's default f16 file."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from PIL import Image

from converter_parity import convert
from edgeserve.vision.family import load_vision
from vision_helpers import picture, tiny_gemma3

transformers = pytest.importorskip("transformers")


def published_layout(folder) -> None:
    """The checkpoint's tower under `vision_tower.vision_model.*`, as google/gemma-3-*-it store it (transformers 5
    saves it as `vision_tower.*`, a layout the converter does not map)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    sd = load_file(path)
    renamed = {("vision_tower.vision_model." + k[len("vision_tower."):] if k.startswith("vision_tower.") else k): v
               for k, v in sd.items()}
    save_file(renamed, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    folder = tiny_gemma3(tmp_path_factory.mktemp("gemma3v"))
    published_layout(folder)
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, model


@pytest.mark.parametrize("outtype,bound", [("f32", 1e-4), ("f16", 2e-2)])
def test_converted_gemma3_mmproj_encodes_as_transformers(tmp_path, gemma3, outtype, bound):
    folder, hf_model = gemma3
    mmproj = convert(folder, tmp_path / f"mmproj-{outtype}.gguf", "--mmproj", outtype=outtype)
    family = load_vision(mmproj, hf_model.config.text_config)
    assert family.projector_type == "gemma3"
    imgs = [Image.open(io.BytesIO(picture(70 + 9 * i, 45, seed=3 + i))).convert("RGB") for i in range(2)]
    prepared = [family.preprocess(i) for i in imgs]
    reference = copy.deepcopy(hf_model)
    projection = reference.model.multi_modal_projector.mm_input_projection_weight
    with torch.no_grad():
        projection.copy_(projection.half().float())  # `mm.input_projection.weight` is F16 in the f32 file too
        out = reference.model.get_image_features(pixel_values=torch.stack([p.pixel_values for p in prepared]))
    want = getattr(out, "pooler_output", out).reshape(2, 4, 64)
    got = torch.stack(family.encode(prepared))
    assert (got - want).abs().max().item() < bound * max(1.0, want.abs().max().item())
    assert (got[0] - got[1]).abs().max() > 1e-2  # two images, two embeddings
