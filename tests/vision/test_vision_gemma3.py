"""Gemma 3 image input: preprocessing and the encoder against transformers (from safetensors and from an mmproj
GGUF written here), and the language model fed an image's rows through the paged cache in chunks."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention
from edgeserve.engine.runner.model_runner import image_rows
from edgeserve.engine.sched.scheduler import ScheduledSeq
from edgeserve.kernels.dispatch import AttentionMetadata
from edgeserve.vision.family import load_vision
from support import mmproj_writer
from support.vision_fixtures import vision_fixtures
from vision_helpers import picture, tiny_gemma3

transformers = pytest.importorskip("transformers")


folder, hf_model, family = vision_fixtures(tiny_gemma3, "gemma3v", "Gemma3ForConditionalGeneration")


@pytest.mark.parametrize("size,fmt", [((37, 53), "PNG"), ((129, 31), "JPEG"), ((64, 64), "PNG")])
def test_preprocessing_matches_the_processor(folder, family, size, fmt):
    img = Image.open(io.BytesIO(picture(*size, seed=sum(size), fmt=fmt))).convert("RGB")
    proc = transformers.Gemma3ImageProcessorPil.from_pretrained(folder)
    want = proc(images=img, return_tensors="pt")["pixel_values"][0]
    got = family.preprocess(img)
    assert got.pixel_values.shape == want.shape and got.num_tokens == 4
    torch.testing.assert_close(got.pixel_values, want, atol=1e-6, rtol=0)


def _hf_features(hf_model, pixels: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = hf_model.model.get_image_features(pixel_values=pixels)
    return getattr(out, "pooler_output", out)


def test_encoder_matches_transformers(family, hf_model):
    imgs = [Image.open(io.BytesIO(picture(50 + i, 40, seed=i))).convert("RGB") for i in range(2)]
    prepared = [family.preprocess(i) for i in imgs]
    want = _hf_features(hf_model, torch.stack([p.pixel_values for p in prepared]))
    got = family.encode(prepared)
    assert got[0].shape == (4, 64)
    torch.testing.assert_close(torch.stack(got), want.reshape(2, 4, 64), atol=1e-4, rtol=1e-4)
    assert (got[0] - got[1]).abs().max() > 1e-2  # two images, two embeddings


def write_mmproj(path, hf_model) -> None:
    """The model's tower and projector as llama.cpp's converter writes an mmproj (clip.cpp's names)."""
    sd = {k: v.float().numpy() for k, v in hf_model.state_dict().items()}
    v = "model.vision_tower."
    if v + "embeddings.patch_embedding.weight" not in sd:
        v = "model.vision_tower.vision_model."
    proj = "model.multi_modal_projector."
    projector = {"mm.input_projection.weight": sd[proj + "mm_input_projection_weight"].astype(np.float16),
                 "mm.soft_emb_norm.weight": sd[proj + "mm_soft_emb_norm.weight"] + 1}
    mmproj_writer.write_mmproj(path, sd, v, hf_model.config.vision_config, "gemma3", projector,
                               {"projector.scale_factor": 4}, f16_matrices=True)


def test_encoder_from_an_mmproj_gguf(tmp_path, family, hf_model):
    write_mmproj(tmp_path / "mmproj.gguf", hf_model)
    from_gguf = load_vision(tmp_path / "mmproj.gguf", hf_model.config.text_config)
    assert from_gguf.projector_type == "gemma3" and from_gguf.settings_digest() != family.settings_digest()
    img = Image.open(io.BytesIO(picture(70, 45, seed=3))).convert("RGB")
    prepared = from_gguf.preprocess(img)
    want = _hf_features(hf_model, prepared.pixel_values[None]).reshape(4, 64)
    # the file stores the matrices as float16
    torch.testing.assert_close(from_gguf.encode([prepared])[0], want, atol=2e-2, rtol=2e-2)


def test_language_model_reads_the_image_rows_in_chunks(folder, family, hf_model):
    """The image's rows replace its placeholders' embeddings (after Gemma's embedding scale), also when prefill
    chunks split the image: the logits are transformers' with the same pixels (causal here: no token_type_ids;
    the image attending both ways is tests/vision/test_vision_gemma3_attention.py)."""
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    lm = load_model(resolve(str(folder)), dtype="float32", device="cpu")
    tok = lm.tokenizer
    img = Image.open(io.BytesIO(picture(33, 47, seed=5))).convert("RGB")
    prepared = family.preprocess(img)
    image_ids, offset = family.prompt_tokens(prepared, tok)
    head = tok.encode("<bos>look:", add_special_tokens=False)
    ids = head + image_ids + tok.encode(" ok", add_special_tokens=False)
    start = len(head) + offset
    rows = family.encode([prepared])[0]
    with torch.no_grad():
        want = hf_model(input_ids=torch.tensor([ids]), pixel_values=prepared.pixel_values[None]).logits[0]
    pool = KVPool(lm.config, 4, 16, lm.model.dtype, lm.model.device)
    hidden = []
    for lo in range(0, len(ids), 5):  # chunks of 5 tokens: the image's 4 rows straddle two chunks
        hi = min(lo + 5, len(ids))
        seq = ScheduledSeq(0, ids[lo:hi], list(range(lo, hi)), list(range(lo, hi)), [0, 1, 2, 3], hi, hi == len(ids),
                           images=((start, rows),))
        meta = AttentionMetadata.build([hi - lo], [hi], [[0, 1, 2, 3]], list(range(lo, hi)))
        hidden.append(lm.model.forward(torch.tensor(ids[lo:hi]), torch.arange(lo, hi), PagedKVAttention(pool, meta),
                                       image_rows=image_rows([seq], torch.device("cpu"))))
    got = lm.model.logits(torch.cat(hidden))
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    # without the rows (the placeholders' own embeddings) the logits after the image differ
    plain = lm.model.logits(lm.model.forward(torch.tensor(ids), torch.arange(len(ids)), PagedKVAttention(
        KVPool(lm.config, 4, 16, lm.model.dtype, lm.model.device),
        AttentionMetadata.build([len(ids)], [len(ids)], [[0, 1, 2, 3]], list(range(len(ids)))))))
    assert (plain[-1] - want[-1]).abs().max() > 1e-2


def test_a_q8_0_mmproj_runs_its_matrices_on_the_native_kernels(tmp_path):
    """mmproj files are often Q8_0: in a reduced-precision dtype on the CPU those matrices stay in their blocks on
    the native kernels, and the encoder agrees with the same file dequantized to float32."""
    from types import SimpleNamespace

    from edgeserve.bench.random_mmproj import write_siglip_mmproj
    from edgeserve.kernels.cpu.native import BlockWeight, available

    if not available():
        pytest.skip("no native CPU kernels on this machine")
    shape = dict(kind="gemma3", hidden=64, ffn=128, layers=2, heads=2, patch=8, image=64, lm=48)
    path = write_siglip_mmproj(tmp_path / "mmproj-q8.gguf", shape, "Q8_0")
    lm = SimpleNamespace(hidden_size=48)
    native = load_vision(path, lm, dtype=torch.bfloat16)
    exact = load_vision(path, lm, dtype=torch.float32)
    assert isinstance(native.tower.weights.layers[0].qkv, BlockWeight)
    assert isinstance(exact.tower.weights.layers[0].qkv, torch.Tensor)
    img = Image.open(io.BytesIO(picture(41, 29, seed=9))).convert("RGB")
    a, b = native.encode([native.preprocess(img)])[0], exact.encode([exact.preprocess(img)])[0]
    assert a.shape == b.shape == (4, 48)
    assert (a - b).abs().max() < 0.05 * b.abs().max()


def test_a_projector_found_beside_a_model_it_does_not_fit_is_left_out(tmp_path):
    """An mmproj that lies beside a GGUF made for another model (another width) leaves the model text-only; the
    same file given with --mmproj is a load error naming the widths."""
    from edgeserve.bench.random_mmproj import write_siglip_mmproj
    from edgeserve.errors import ModelLoadError
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve
    from edgeserve.vision.runtime import find_mmproj, load_runtime
    from tiny_gguf import write_tiny_llama

    model = write_tiny_llama(tmp_path / "tiny.gguf")
    shape = dict(kind="gemma3", hidden=32, ffn=64, layers=1, heads=2, patch=8, image=64, lm=48)
    proj = write_siglip_mmproj(tmp_path / "mmproj-other.gguf", shape, "F16")
    source = resolve(str(model))
    lm = load_model(source, dtype="float32")
    assert find_mmproj(model) == proj and lm.config.hidden_size != 48
    assert load_runtime(source, lm) is None
    with pytest.raises(ModelLoadError, match="48 wide rows"):
        load_runtime(source, lm, proj)
