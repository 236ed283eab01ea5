"""Whole tiny Qwen3-VL (vision tower + DeepStack + interleaved M-RoPE) and Qwen2.5-VL (window-attention tower +
M-RoPE in sections) models through the engine: greedy generation with an image equals transformers' generate()
(float32), with prefill chunks that split the image, and the M-RoPE positions equal transformers' get_rope_index;
then through the server's OpenAI and Ollama routes."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from edgeserve.engine.delivery import Outbox, step_and_deliver
from edgeserve.llm import LLM
from edgeserve.models.mrope import mrope_positions
from edgeserve.sampling_params import SamplingParams
from edgeserve.vision.family import load_vision
from vision_helpers import byte_tokenizer, picture

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NEW_TOKENS = 8
HIDDEN = 32
KINDS = {  # each family's tiny shapes: Qwen3-VL (patch 16, DeepStack), Qwen2.5-VL (patch 14, windows of 2x2 units)
    "qwen3": dict(patch=16, processor=dict(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3),
                  vision=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=HIDDEN,
                              patch_size=16, num_position_embeddings=16, deepstack_visual_indexes=[0, 1])),
    "qwen25": dict(patch=14, processor={},
                   vision=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=HIDDEN,
                               patch_size=14, window_size=56, fullatt_block_indexes=[2])),
}


def processor(kind: str) -> Qwen2VLImageProcessorPil:
    unit = KINDS[kind]["patch"] * 2
    return Qwen2VLImageProcessorPil(min_pixels=unit * unit * 4, max_pixels=unit * unit * 12,
                                    **KINDS[kind]["processor"])


@pytest.fixture(scope="module", params=list(KINDS))
def folder(request, tmp_path_factory):
    """A random tiny Qwen3-VL / Qwen2.5-VL saved by transformers, with a byte-level tokenizer holding Qwen's vision
    tokens."""
    kind = request.param
    folder = tmp_path_factory.mktemp(f"{kind}-")
    vocab = byte_tokenizer(folder, SPECIALS, TEMPLATE, "<|endoftext|>", "<|im_end|>")
    torch.manual_seed(0)
    text = dict(vocab_size=len(vocab), hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=3,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": kind == "qwen3"})
    classes = {"qwen3": (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration),
               "qwen25": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration)}
    config_class, model_class = classes[kind]
    cfg = config_class(text_config=text, vision_config=KINDS[kind]["vision"], image_token_id=vocab["<|image_pad|>"],
                       vision_start_token_id=vocab["<|vision_start|>"], vision_end_token_id=vocab["<|vision_end|>"],
                       tie_word_embeddings=False, eos_token_id=vocab["<|im_end|>"], pad_token_id=0)
    model = model_class(cfg).eval()
    with torch.no_grad():  # wide weights: peaked logits (no greedy near-ties), DeepStack and positions that matter
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name and "weight" in name else 0.0, 0.3)
    model.save_pretrained(folder)
    processor(kind).save_pretrained(folder)
    return folder


def kind_of(folder) -> str:
    """The family of a `folder` fixture's model (its folder is named `KIND-N`)."""
    return folder.name.rsplit("-", 1)[0]


@pytest.fixture(scope="module")
def hf_model(folder):
    model_class = transformers.AutoModelForImageTextToText
    model = model_class.from_pretrained(folder, dtype=torch.float32)
    model.config._attn_implementation = "eager"
    return model.eval()


@pytest.fixture(scope="module")
def llm(folder):
    # 16-token steps: the image's placeholders span several prefill chunks
    return LLM(str(folder), dtype="float32", device="cpu", max_num_batched_tokens=16)


def image_prompt(llm, family, seed: int):
    """Token ids of a user turn with one image, the image's prepared form, its first placeholder index."""
    tok = llm.tokenizer
    img = Image.open(io.BytesIO(picture(45, 70, seed=seed))).convert("RGB")
    prepared = family.preprocess(img)
    image_ids, offset = family.prompt_tokens(prepared, tok)
    head = tok.encode("<|im_start|>user\nlook ", add_special_tokens=False)
    tail = tok.encode(" what?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    return head + image_ids + tail, img, len(head) + offset, prepared


def generate(llm, requests) -> list[list[int]]:
    """Greedy tokens of each (ids, images, mrope) request, run together in one engine."""
    outbox, results = Outbox(), {}
    for ids, images, mrope in requests:
        rid = llm.engine.add_request(ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
                                     images=images, mrope=mrope)
        results[rid] = []
        outbox.open(rid, lambda out, rid=rid: results[rid].extend(out.token_ids)
                    if not isinstance(out, Exception) else None)
    while llm.engine.has_work():
        step_and_deliver(llm.engine, outbox)
    return list(results.values())


def test_generation_with_an_image_matches_transformers(folder, hf_model, llm):
    family = load_vision(folder, llm.lm.config)
    ids, img, start, prepared = image_prompt(llm, family, seed=3)
    rows = family.encode([prepared])[0]
    # Qwen3-VL: the embeddings and two DeepStack layers' features
    assert rows.shape[1] == HIDDEN * (3 if kind_of(folder) == "qwen3" else 1)
    mrope = mrope_positions(len(ids), [(start, family.mrope_grid(prepared))])
    pixels = processor(kind_of(folder))(images=[img], return_tensors="pt")
    input_ids = torch.tensor([ids])
    types = (input_ids == hf_model.config.image_token_id).int()  # the processor's mm_token_type_ids
    with torch.no_grad():
        want = hf_model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 mm_token_type_ids=types, pixel_values=pixels["pixel_values"],
                                 image_grid_thw=pixels["image_grid_thw"], max_new_tokens=NEW_TOKENS,
                                 do_sample=False)[0, len(ids):].tolist()
        hf_positions, hf_delta = hf_model.model.get_rope_index(input_ids, types,
                                                               image_grid_thw=pixels["image_grid_thw"])
    assert torch.equal(mrope.prompt, hf_positions[:, 0]) and mrope.delta == int(hf_delta)
    # beside it, the same prompt with no image rows (the placeholders' own embeddings, 1-D positions)
    got, plain = generate(llm, [(ids, [(start, rows)], mrope), (list(ids), [], None)])
    assert got == want
    assert got != plain  # the image steers the answer


def test_deepstack_and_mrope_each_matter(folder, llm):
    """Dropping the DeepStack features, or the (t, h, w) positions, changes the answer (the parity above tests
    both)."""
    if kind_of(folder) != "qwen3":
        pytest.skip("DeepStack is Qwen3-VL's")
    family = load_vision(folder, llm.lm.config)
    ids, _, start, prepared = image_prompt(llm, family, seed=4)
    rows = family.encode([prepared])[0]
    mrope = mrope_positions(len(ids), [(start, family.mrope_grid(prepared))])
    full, no_deep, flat = generate(llm, [(ids, [(start, rows)], mrope), (ids, [(start, rows[:, :HIDDEN])], mrope),
                                         (ids, [(start, rows)], None)])
    assert full != no_deep and full != flat


def hf_answer(hf_model, kind: str, tok, img: Image.Image, head: str, tail: str) -> str:
    """transformers' greedy answer (text up to the end of turn) to a user turn `head` + the image + `tail`."""
    pixels = processor(kind)(images=[img], return_tensors="pt")
    n = int(pixels["image_grid_thw"][0].prod()) // 4
    image_ids = [tok.token_to_id(t) for t in ["<|vision_start|>"] + ["<|image_pad|>"] * n + ["<|vision_end|>"]]
    ids = tok.encode(f"<|im_start|>user\n{head}", add_special_tokens=False) + image_ids + tok.encode(
        f"{tail}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = hf_model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                mm_token_type_ids=(input_ids == hf_model.config.image_token_id).int(),
                                pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                                max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):].tolist()
    eos = tok.token_to_id("<|im_end|>")
    text = tok.decode(out[: out.index(eos)] if eos in out else out, skip_special_tokens=True)
    assert text  # an empty answer would make the comparisons vacuous
    return text


def test_the_server_answers_an_image_as_transformers_does(folder, hf_model):
    """Through the HTTP pipeline (OpenAI `image_url`, Ollama `images`): the prompt's image placed, encoded, its
    M-RoPE positions and DeepStack rows reaching the engine; greedy text equals transformers' generate()."""
    import base64

    import httpx

    from edgeserve.engine.config import EngineConfig
    from edgeserve.loaders.tokenizer import tokenizer_from_hf_folder
    from edgeserve.server import ServerConfig
    from server_helpers import serve
    from vision_helpers import data_url

    png = picture(45, 70, seed=6)
    img = Image.open(io.BytesIO(png)).convert("RGB")
    tok = tokenizer_from_hf_folder(folder)
    config = ServerConfig(models=(str(folder),), dtype="float32", device="cpu",
                          engine=EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, kv_cache_gb=0.05))
    with serve(config) as server:
        chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "model": str(folder), "temperature": 0, "max_tokens": NEW_TOKENS, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "look "}, {"type": "image_url", "image_url": {"url": data_url(png)}},
                {"type": "text", "text": " what?"}]}]})
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["message"]["content"] == hf_answer(hf_model, kind_of(folder), tok, img,
                                                                            "look ", " what?")
        ollama = httpx.post(f"{server.url}/api/chat", timeout=120, json={
            "model": str(folder), "stream": False, "options": {"temperature": 0, "num_predict": NEW_TOKENS},
            "messages": [{"role": "user", "content": "what?", "images": [base64.b64encode(png).decode()]}]})
        assert ollama.status_code == 200, ollama.text
        # Ollama's images come before the message's text
        assert ollama.json()["message"]["content"] == hf_answer(hf_model, kind_of(folder), tok, img, "", "what?")
        sliver = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "model": str(folder), "max_tokens": 1, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(picture(603, 3, seed=1))}}]}]})
        assert sliver.status_code == 400 and "aspect ratio" in sliver.json()["error"]["message"]


def test_the_llm_api_answers_an_image_as_transformers_does(folder, hf_model, llm):
    """`LLM.image_prompt` (what `edgeserve run --image` uses) passes the prompt's M-RoPE positions on."""
    png = picture(45, 70, seed=7)
    img = Image.open(io.BytesIO(png)).convert("RGB")
    ids, request = llm.image_prompt("what?", [img])
    assert "mrope" in request
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    tokens = [t for out in llm.stream(ids, params, **request) for t in out.token_ids]
    text = llm.tokenizer.decode(tokens, skip_special_tokens=True)
    assert text == hf_answer(hf_model, kind_of(folder), llm.tokenizer, img, "", "what?")
