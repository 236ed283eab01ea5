"""Gemma 3's prefill lets the tokens of one image attend to each other both ways (transformers' mask: causal OR same
image, AND the window on sliding layers): the language model's logits equal transformers' with the processor's
token_type_ids, near the start and past the sliding window; the scheduler never cuts an image across prefill chunks,
so the engine's answer with a small token budget and with a prefix-cache hit that ends inside the image is
transformers' too; the native attention keeps the same rule (global and windowed rows)."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from edgeserve.engine.delivery import Outbox, step_and_deliver
from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention
from edgeserve.engine.runner.model_runner import image_rows
from edgeserve.engine.sched.scheduler import ScheduledSeq, span_stop
from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.torch import paged_attention as torch_attention
from edgeserve.kernels.dispatch import AttentionMetadata
from edgeserve.kernels.dispatch import paged_attention as dispatched_attention
from edgeserve.sampling_params import SamplingParams
from edgeserve.vision.family import load_vision
from vision_helpers import picture, tiny_gemma3

transformers = pytest.importorskip("transformers")
TOKENS = 16  # placeholders per image (4 x 4 pooled patches)
WINDOW = 64  # the tiny model's sliding window
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Gemma 3 with a sliding and a global layer, its weights wide enough that logits are peaked."""
    path = tiny_gemma3(tmp_path_factory.mktemp("gemma3-bidi"), seed=1, tokens=TOKENS)
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    model.config.text_config.layer_types = ["sliding_attention", "full_attention"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name and "norm" not in name:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_model(folder):
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    model.config._attn_implementation = "eager"
    assert model.config.text_config.layer_types == ["sliding_attention", "full_attention"]
    return model.eval()


@pytest.fixture(scope="module")
def lm(folder):
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    return load_model(resolve(str(folder)), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def family(folder, lm):
    return load_vision(folder, lm.config)


def prompt(lm, family, head: str, tail: str, seed: int = 5):
    """Token ids of `head` + one image + `tail`, the image's [start, end) placeholder span, its prepared form."""
    tok = lm.tokenizer
    prepared = family.preprocess(Image.open(io.BytesIO(picture(43, 37, seed=seed))).convert("RGB"))
    image_ids, offset = family.prompt_tokens(prepared, tok)
    ids = tok.encode(head, add_special_tokens=False)
    start = len(ids) + offset
    ids += image_ids + tok.encode(tail, add_special_tokens=False)
    return ids, (start, start + TOKENS), prepared


def hf_logits(hf_model, ids: list[int], prepared) -> torch.Tensor:
    input_ids = torch.tensor([ids])
    types = (input_ids == hf_model.config.image_token_id).long()  # the processor's token_type_ids
    with torch.no_grad():
        return hf_model(input_ids=input_ids, token_type_ids=types,
                        pixel_values=prepared.pixel_values[None]).logits[0]


def forward(lm, ids, span, rows, chunks: list[int], spans: bool = True) -> torch.Tensor:
    """The model's logits over `ids` computed in prefill chunks of the given sizes over one paged pool."""
    blocks = -(-len(ids) // 16)
    pool = KVPool(lm.config, blocks, 16, lm.model.dtype, lm.model.device)
    table = list(range(blocks))
    hidden, lo = [], 0
    for n in chunks:
        hi = lo + n
        attend = (span,) if spans else ()
        seq = ScheduledSeq(0, ids[lo:hi], list(range(lo, hi)), list(range(lo, hi)), table, hi, hi == len(ids),
                           images=((span[0], rows),), attend_spans=attend)
        meta = AttentionMetadata.build([n], [hi], [table], list(range(lo, hi)))
        meta.attend_spans = [attend] if attend and span[0] < hi and span[1] > lo else None
        hidden.append(lm.model.forward(torch.tensor(ids[lo:hi]), torch.arange(lo, hi), PagedKVAttention(pool, meta),
                                       image_rows=image_rows([seq], torch.device("cpu"))))
        lo = hi
    return lm.model.logits(torch.cat(hidden))


@pytest.mark.parametrize("head", ["<bos>look:", "<bos>" + "a long preamble before the picture, " * 3])
def test_logits_equal_transformers_with_the_image_attending_both_ways(lm, family, hf_model, head):
    """Near the start, and with the image past the sliding window (its rows then see the window of their own
    position and the rest of the image)."""
    ids, span, prepared = prompt(lm, family, head, " ok, what is it?")
    assert (span[1] > WINDOW) == (len(head) > 20)
    want = hf_logits(hf_model, ids, prepared)
    rows = family.encode([prepared])[0]
    got = forward(lm, ids, span, rows, [len(ids)])
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    causal = forward(lm, ids, span, rows, [len(ids)], spans=False)  # what we computed before: causal throughout
    assert (causal[span[0]:] - want[span[0]:]).abs().max() > 0.05


def test_chunks_that_never_cut_the_image_give_the_whole_prompt_s_logits(lm, family, hf_model):
    ids, span, prepared = prompt(lm, family, "<bos>look at this:", " ok")
    rows = family.encode([prepared])[0]
    chunks, lo = [], 0
    while lo < len(ids):  # chunks of 5 as the scheduler cuts them: past the image where one starts inside it
        hi = span_stop(lo, min(lo + 5, len(ids)), (span,))
        chunks.append(hi - lo)
        lo = hi
    assert TOKENS in chunks or TOKENS + 1 in chunks or any(c > 5 for c in chunks)
    whole = forward(lm, ids, span, rows, [len(ids)])
    torch.testing.assert_close(forward(lm, ids, span, rows, chunks), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(whole, hf_logits(hf_model, ids, prepared), atol=2e-3, rtol=2e-3)


def test_span_stop_moves_a_chunk_end_out_of_a_span():
    spans = ((10, 26), (40, 44))
    assert span_stop(0, 8, spans) == 8  # before the image
    assert span_stop(0, 15, spans) == 10  # would cut it: stops before it
    assert span_stop(10, 12, spans) == 26  # starts at it: takes all of it, past the budget
    assert span_stop(18, 20, spans) == 26  # starts inside it (a prefix-cache hit): the rest of it
    assert span_stop(26, 42, spans) == 40 and span_stop(26, 44, spans) == 44


def hf_generate(hf_model, ids, prepared) -> list[int]:
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = hf_model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                token_type_ids=(input_ids == hf_model.config.image_token_id).long(),
                                pixel_values=prepared.pixel_values[None], max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(ids):].tolist()


def test_the_engine_answers_as_transformers_with_small_chunks_and_a_hit_inside_the_image(folder, family,
                                                                                          hf_model):
    """8-token steps (the image's 16 tokens go in one chunk past the budget); then the same image with another
    question, whose prefix-cache hit ends inside the image (the rest of the image is computed seeing the cached
    part): both are transformers' greedy answers."""
    from edgeserve.llm import LLM

    llm = LLM(str(folder), dtype="float32", device="cpu", max_num_batched_tokens=8)
    first, span, prepared = prompt(llm.lm, family, "<bos>look at this:", " what?")
    second, span2, _ = prompt(llm.lm, family, "<bos>look at this:", " and now?")
    assert span == span2 and span[0] // 16 < span[1] // 16 and span[1] % 16  # a block boundary inside the image
    rows = family.encode([prepared])[0]
    from edgeserve.vision.prompt import ImagePrompt, PlacedImage

    key = ImagePrompt(first, [PlacedImage([(span[0], TOKENS)], prepared, b"img")]).prefix_key()
    outs = []
    for ids in (first, second):
        outbox, deltas = Outbox(), []
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
        rid = llm.engine.add_request(ids, params, prefix_key=key, images=[(span[0], rows)], attend_spans=[span])
        outbox.open(rid, deltas.append)
        while llm.engine.has_work():
            step_and_deliver(llm.engine, outbox)
        assert not any(isinstance(d, Exception) for d in deltas)
        top = [lp for _, lp in [d for d in deltas if d.logprobs][0].logprobs[0].top]
        outs.append(([t for d in deltas for t in d.token_ids], deltas[-1].num_cached_tokens, top))
    (got1, cached1, top1), (got2, cached2, top2) = outs
    assert cached1 == 0 and span[0] < cached2 < span[1]
    for ids, got, top in ((first, got1, top1), (second, got2, top2)):
        assert got == hf_generate(hf_model, ids, prepared)
        # the first token's distribution: its best logprobs are transformers' (a cut image moves them by ~0.1)
        want = torch.log_softmax(hf_logits(hf_model, ids, prepared)[-1], dim=-1).topk(5).values
        torch.testing.assert_close(torch.tensor(top), want, atol=2e-3, rtol=0)


def test_a_span_past_the_prompt_is_a_clear_error(folder):
    from edgeserve.engine.sched.request_check import InvalidRequestError, check_spans

    assert check_spans([(5, 9), (1, 3)], 10) == ((1, 3), (5, 9))
    for bad in ([(3, 3)], [(5, 11)], [(1, 5), (4, 6)]):
        with pytest.raises(InvalidRequestError, match="attention spans"):
            check_spans(bad, 10)


@pytest.mark.skipif(not cpu_native.available(), reason="no native CPU kernels here")
@pytest.mark.parametrize("window", [None, 6])
def test_native_attention_honours_spans_as_the_reference(window):
    """Two sequences in one step (a chunk with an image span past the window, a chunk after a cached part of its
    span) against a float64 loop of transformers' rule: window AND (causal OR same span)."""
    g = torch.Generator().manual_seed(0)
    bs, hkv, heads, d = 16, 2, 4, 32
    k_cache = torch.randn(8, bs, hkv, d, generator=g)
    v_cache = torch.randn(8, bs, hkv, d, generator=g)
    spans = [((9, 14),), ((2, 12),)]
    pasts, lens = [3, 5], [15, 10]  # sequence 1's chunk starts inside its span (positions 5..14)
    tables = [[0, 1], [4, 5]]
    rows = sum(lens)
    q = torch.randn(rows, heads, d, generator=g)
    slots = [t[p // bs] * bs + p % bs for t, past, n in zip(tables, pasts, lens) for p in range(past, past + n)]
    meta = AttentionMetadata.build(lens, [p + n for p, n in zip(pasts, lens)], tables, slots)
    meta.attend_spans = spans
    got = dispatched_attention(q, k_cache, v_cache, meta, window=window)
    twin = torch_attention.paged_attention(q, k_cache, v_cache, meta, window=window)
    want = torch.empty(rows, heads, d, dtype=torch.float64)
    r = 0
    for (span,), t, past, n in zip(spans, tables, pasts, lens):
        keys = torch.arange(past + n)
        flat = torch.tensor([t[p // bs] * bs + p % bs for p in keys.tolist()])
        kk = k_cache.flatten(0, 1)[flat].double().repeat_interleave(heads // hkv, dim=1)
        vv = v_cache.flatten(0, 1)[flat].double().repeat_interleave(heads // hkv, dim=1)
        for p in range(past, past + n):
            seen = (keys <= p) | ((keys >= span[0]) & (keys < span[1]) & (span[0] <= p < span[1]))
            if window is not None:
                seen &= keys > p - window
            w = torch.einsum("hd,nhd->hn", q[r].double(), kk) * d ** -0.5
            w = torch.softmax(w.masked_fill(~seen, float("-inf")), dim=-1)
            want[r] = torch.einsum("hn,nhd->hd", w, vv)
            r += 1
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(twin.double(), want, atol=1e-5, rtol=1e-5)
    meta.attend_spans, meta.native_rows, meta.torch_plan, meta.torch_window_plans = None, None, None, {}
    assert (dispatched_attention(q, k_cache, v_cache, meta, window=window).double() - want).abs().max() > 0.05


@pytest.mark.skipif(not cpu_native.available(), reason="no native CPU kernels here")
def test_the_fused_native_stack_honours_spans_or_leaves_the_step_to_the_per_op_path(tmp_path):
    """Gemma 3 on a Q8_0 GGUF (window 5): a span within the first window runs in the fused stack and gives the
    per-op path's hidden states bit for bit; a span past the window is left to the per-op path, whose windowed rows
    start from their own position."""
    from test_cpu_decoder_gemma import gemma_q8

    model = gemma_q8(tmp_path / "g.gguf")

    def step(n: int, spans: tuple, fused: bool):
        model._native = False if fused else None  # False: plan on the next forward; None: the per-op path
        pool = KVPool(model.config, 2, 16, model.dtype)
        meta = AttentionMetadata.build([n], [n], [[0, 1]], list(range(n)))
        meta.attend_spans = [spans] if spans else None
        attn = PagedKVAttention(pool, meta)
        ids = torch.tensor([(7 * p + 3) % (model.config.vocab_size - 3) + 3 for p in range(n)])
        out = model.forward(ids, torch.arange(n), attn)
        return out, model._native is not None and model._native.runs(attn)

    inside, ran = step(9, ((1, 5),), True)
    assert ran and torch.equal(inside, step(9, ((1, 5),), False)[0])
    assert not torch.equal(inside, step(9, (), True)[0])
    past, ran = step(14, ((8, 12),), True)
    assert not ran and torch.equal(past, step(14, ((8, 12),), False)[0])
    assert not torch.equal(past, step(14, (), True)[0])


def test_the_server_pipeline_sends_each_image_s_placeholders_as_a_span(lm, family):
    from edgeserve.server.image_input import encode_images
    from edgeserve.vision.prompt import image_mark, image_prompt
    from edgeserve.vision.runtime import VisionRuntime

    imgs = {i: Image.open(io.BytesIO(picture(30 + i, 40, seed=i))).convert("RGB") for i in range(2)}
    placed = image_prompt(f"<bos>a{image_mark(0)}b{image_mark(1)}c", imgs, family, lm.tokenizer, lambda d: d)
    args = encode_images(placed, VisionRuntime(family), 0.0).engine_args()
    image_id = lm.tokenizer.token_to_id("<image_soft_token>")
    assert len(args["attend_spans"]) == 2
    for a, b in args["attend_spans"]:
        assert b - a == TOKENS and set(placed.ids[a:b]) == {image_id}
        assert placed.ids[a - 1] != image_id and placed.ids[b] != image_id
