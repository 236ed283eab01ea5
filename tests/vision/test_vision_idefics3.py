"""SmolVLM / Idefics3 image input: tiling preprocessing, the prompt's tile tokens and the encoder against
transformers (from safetensors and from an mmproj GGUF written here), and the language model fed every tile's
rows."""

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
from edgeserve.vision.prompt import image_mark, image_prompt
from support import mmproj_writer
from support.vision_fixtures import vision_fixtures
from vision_helpers import picture, tiny_smolvlm

transformers = pytest.importorskip("transformers")
SIZES = [(37, 53), (129, 31), (20, 20), (64, 64)]


folder, hf_model, family = vision_fixtures(tiny_smolvlm, "smolvlm", "Idefics3ForConditionalGeneration")


@pytest.fixture(scope="module")
def processor(folder):
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    return transformers.Idefics3Processor(transformers.Idefics3ImageProcessorPil.from_pretrained(folder), tok,
                                          image_seq_len=4)


def _image(size, seed=1, fmt="PNG"):
    return Image.open(io.BytesIO(picture(*size, seed=seed, fmt=fmt))).convert("RGB")


def _hf_features(hf_model, pixels, mask):
    with torch.no_grad():
        out = hf_model.model.get_image_features(pixel_values=pixels, pixel_attention_mask=mask)
    out = getattr(out, "pooler_output", out)
    return torch.cat(list(out)) if isinstance(out, (list, tuple)) else out.reshape(-1, out.shape[-1])


@pytest.mark.parametrize("size", SIZES)
def test_tiles_match_the_processor(family, processor, size):
    img = _image(size, fmt="JPEG" if size[0] > 100 else "PNG")
    want = processor(text="<image>", images=[img], return_tensors="pt")
    got = family.preprocess(img)
    torch.testing.assert_close(got.pixel_values, want["pixel_values"][0], atol=1e-6, rtol=0)
    assert got.num_tokens == 4 * got.pixel_values.shape[0]


@pytest.mark.parametrize("size", SIZES[:2])
def test_prompt_ids_match_the_processor(folder, family, processor, size):
    from edgeserve.loaders.tokenizer import tokenizer_from_hf_folder

    img = _image(size)
    want = processor(text="look <image> now", images=[img])["input_ids"][0]
    tok = tokenizer_from_hf_folder(folder)
    placed = image_prompt(f"look {image_mark(0)} now", {0: img}, family, tok, lambda d: d)
    assert placed.ids == list(want)
    runs = placed.images[0].runs
    assert len(runs) == family.preprocess(img).pixel_values.shape[0] and all(n == 4 for _, n in runs)


def test_encoder_matches_transformers(family, hf_model, processor):
    imgs = [_image((50, 40), seed=2), _image((30, 90), seed=3)]
    prepared = [family.preprocess(i) for i in imgs]
    got = family.encode(prepared)
    for img, p, g in zip(imgs, prepared, got):
        want = processor.image_processor(images=img, return_tensors="pt")
        ref = _hf_features(hf_model, want["pixel_values"], want["pixel_attention_mask"])
        assert g.shape == (p.num_tokens, 64)
        torch.testing.assert_close(g, ref, atol=1e-4, rtol=1e-4)


def write_mmproj(path, hf_model, longest: int) -> None:
    """The tower and connector as llama.cpp's converter writes a SmolVLM mmproj."""
    sd = {k: v.float().numpy() for k, v in hf_model.state_dict().items()}
    projector = {"mm.model.fc.weight": sd["model.connector.modality_projection.proj.weight"]}
    mmproj_writer.write_mmproj(path, sd, "model.vision_model.", hf_model.config.vision_config, "idefics3", projector,
                               {"projector.scale_factor": 2, "preproc_image_size": longest})


def test_encoder_from_an_mmproj_gguf(tmp_path, family, hf_model):
    write_mmproj(tmp_path / "mmproj.gguf", hf_model, 64)
    from_gguf = load_vision(tmp_path / "mmproj.gguf", hf_model.config.text_config)
    img = _image((45, 70), seed=4)
    a, b = from_gguf.preprocess(img), family.preprocess(img)
    assert a.grid == b.grid and torch.equal(a.pixel_values, b.pixel_values)
    torch.testing.assert_close(from_gguf.encode([a])[0], family.encode([b])[0], atol=1e-5, rtol=1e-5)


def test_language_model_reads_every_tile(folder, family, hf_model, processor):
    """All the image's runs of rows reach the model, through prefill chunks that split them: transformers'
    logits for the processor's ids and pixels."""
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    lm = load_model(resolve(str(folder)), dtype="float32", device="cpu")
    img = _image((50, 33), seed=6)
    inputs = processor(text="see <image> ok", images=[img], return_tensors="pt")
    placed = image_prompt(f"see {image_mark(0)} ok", {0: img}, family, lm.tokenizer, lambda d: d)
    ids = placed.ids
    assert ids == inputs["input_ids"][0].tolist()
    rows = placed.engine_images(family.encode([placed.images[0].prepared]))
    with torch.no_grad():
        want = hf_model(**inputs).logits[0]
    n_blocks = -(-len(ids) // 16)
    table = list(range(n_blocks))
    pool = KVPool(lm.config, n_blocks, 16, lm.model.dtype, lm.model.device)
    hidden = []
    for lo in range(0, len(ids), 7):
        hi = min(lo + 7, len(ids))
        seq = ScheduledSeq(0, ids[lo:hi], list(range(lo, hi)), list(range(lo, hi)), table, hi, hi == len(ids),
                           images=tuple(rows))
        meta = AttentionMetadata.build([hi - lo], [hi], [table], list(range(lo, hi)))
        hidden.append(lm.model.forward(torch.tensor(ids[lo:hi]), torch.arange(lo, hi), PagedKVAttention(pool, meta),
                                       image_rows=image_rows([seq], torch.device("cpu"))))
    torch.testing.assert_close(lm.model.logits(torch.cat(hidden)), want, atol=2e-3, rtol=2e-3)
    assert np.isfinite(want.numpy()).all()


def test_generation_with_an_image_through_smolvlms_own_template(folder):
    """SmolVLM's template reads content only as parts: text and images still reach the prompt, and the engine runs
    a request with the image's rows; text-only chat renders its text too."""
    from edgeserve.llm import LLM
    from edgeserve.sampling_params import SamplingParams

    llm = LLM(str(folder), dtype="float32", kv_cache_gb=0.01)
    try:
        ids, request = llm.image_prompt("see", [_image((40, 30), seed=8)])
        text = llm.lm.tokenizer.decode(ids)
        assert "User: " in text and "see<end_of_utterance>" in text and "<global-img>" in text
        params = SamplingParams(max_tokens=4, temperature=0)
        with_image = [t for d in llm.stream(ids, params, **request) for t in d.token_ids]
        first = request["images"][0][0]
        assert len(with_image) == 4 and ids[first] == llm.lm.tokenizer.token_to_id("<image>")
        plain = llm.chat([{"role": "user", "content": "hello"}], params)[0]
        assert "hello" in llm.lm.tokenizer.decode(plain.prompt_token_ids)
    finally:
        llm.close()
