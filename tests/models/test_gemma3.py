"""Gemma 3 on the real 270M Q4_K_M file (catalog `gemma3-270m`): logits against transformers on the same GGUF,
greedy generation, sliding-window attention through the paged cache, chunked prefill and the prefix cache."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention
from edgeserve.kernels.dispatch import AttentionMetadata
from edgeserve.llm import LLM
from edgeserve.models.attention import ContiguousKV
from edgeserve.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village by the sea,"]
COLORS = ["red", "green", "blue", "yellow", "black", "white", "orange"]
# well past the 512-token window of the sliding layers
LONG_TEXT = " ".join(f"Box {i} is {COLORS[i % 7]} and holds {i * 7 % 31} marbles." for i in range(52)) + \
    " The box that holds the most marbles is Box"


@pytest.fixture(scope="module")
def gemma_path():
    from edgeserve.registry import pull

    return pull("gemma3-270m", progress=False)


@pytest.fixture(scope="module")
def gemma_fp32(gemma_path):
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    return load_model(resolve(str(gemma_path)), dtype="float32")


@pytest.fixture(scope="module")
def hf_gemma(gemma_path):
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gemma_path.parent), gguf_file=gemma_path.name, dtype=torch.float32)
    return model.eval()


def hf_logits(model, ids: list[int], keep: int = 0) -> torch.Tensor:
    """transformers' logits of the last `keep` positions (0: all)."""
    with torch.no_grad():
        return model(torch.tensor([ids]), logits_to_keep=keep).logits[0].float()


def paged_logits(lm, ids: list[int], chunk: int, keep: int, block_size: int = 16) -> torch.Tensor:
    """Logits of the last `keep` positions, the prompt fed in chunks of `chunk` tokens through a paged KV pool."""
    model = lm.model
    n_blocks = -(-len(ids) // block_size)
    pool = KVPool(lm.config, n_blocks, block_size, model.dtype, model.device)
    table = list(range(n_blocks))
    hidden = []
    for start in range(0, len(ids), chunk):
        end = min(start + chunk, len(ids))
        meta = AttentionMetadata.build([end - start], [end], [table], list(range(start, end)))
        hidden.append(model.forward(torch.tensor(ids[start:end]), torch.arange(start, end), PagedKVAttention(pool, meta)))
    return model.logits(torch.cat(hidden)[-keep:])


def test_config_from_the_file(gemma_fp32) -> None:
    c = gemma_fp32.config
    assert c.architecture == "gemma3" and c.vocab_size == 262144 and c.qk_norm and c.sandwich_norms
    assert c.layer_windows is not None and c.layer_windows.count(None) == c.num_layers // 6
    assert set(c.layer_windows) == {512, None} and c.rope_local_theta == 10000.0 and c.rope_theta == 1e6
    tok = gemma_fp32.tokenizer
    assert tok.encode("Hello")[0] == tok.bos_id == 2
    text = gemma_fp32.chat_template.render([{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Hi"}])
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert tok.backend.token_to_id("<end_of_turn>") in tok.eot_ids


def test_logits_match_transformers(gemma_fp32, hf_gemma) -> None:
    for prompt in PROMPTS:
        ids = gemma_fp32.tokenizer.encode(prompt)
        kv = ContiguousKV(gemma_fp32.config.num_layers, len(ids), gemma_fp32.config.num_kv_heads,
                          gemma_fp32.config.head_dim, torch.float32)
        ours = gemma_fp32.model.logits(gemma_fp32.model.forward(torch.tensor(ids), torch.arange(len(ids)), kv))
        ref = hf_logits(hf_gemma, ids)
        assert (ours - ref).abs().max().item() < 2e-3, prompt


def test_sliding_window_through_paged_cache_matches_transformers(gemma_fp32, hf_gemma) -> None:
    ids = gemma_fp32.tokenizer.encode(LONG_TEXT)
    assert len(ids) > 540
    ref = hf_logits(hf_gemma, ids, keep=32)
    for chunk in (len(ids), 100):
        ours = paged_logits(gemma_fp32, ids, chunk, keep=32)
        assert (ours - ref).abs().max().item() < 5e-3, chunk
    # the window matters: the same model attending to everything is clearly off
    model = gemma_fp32.model
    full = dataclasses.replace(model.config, layer_windows=None)
    model.config, saved = full, model.config
    try:
        unwindowed = paged_logits(gemma_fp32, ids, len(ids), keep=32)
    finally:
        model.config = saved
    assert (unwindowed - ref).abs().max().item() > 0.1


def _greedy_reference(hf_gemma, ids: list[int], n: int) -> list[int]:
    """transformers' greedy tokens, cut before the first step whose top two logits are a near-tie."""
    with torch.no_grad():
        out = hf_gemma.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, output_scores=True,
                                return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    for step, scores in enumerate(out.scores):
        top = scores[0].float().topk(2).values
        if (top[0] - top[1]).item() < 1e-3:
            return tokens[:step]
    return tokens


def test_greedy_32_tokens_match_transformers(gemma_fp32, hf_gemma) -> None:
    llm = LLM.from_model(gemma_fp32)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    results = llm.generate(PROMPTS, params)
    for prompt, result in zip(PROMPTS, results):
        ref = _greedy_reference(hf_gemma, result.prompt_token_ids, 32)
        assert len(ref) >= 8, prompt
        assert result.outputs[0].token_ids[: len(ref)] == ref, prompt


def test_long_prompt_in_one_piece_and_chunked_agree(gemma_fp32) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    whole = LLM.from_model(gemma_fp32, max_num_batched_tokens=2048).generate(LONG_TEXT, params)[0]
    chunked = LLM.from_model(gemma_fp32, max_num_batched_tokens=96).generate(LONG_TEXT, params)[0]
    assert len(whole.prompt_token_ids) > 512
    assert whole.outputs[0].token_ids == chunked.outputs[0].token_ids


def test_prefix_cache_across_the_window_gives_the_same_tokens(gemma_fp32) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = LONG_TEXT
    second = LONG_TEXT + " 12. Which box is green? Box"
    cached = LLM.from_model(gemma_fp32, max_num_batched_tokens=256, enable_prefix_caching=True)
    cached.generate(first, params)
    hit = cached.generate(second, params)[0]
    assert hit.num_cached_tokens > 512  # the reused prefix spans more than a window
    fresh = LLM.from_model(gemma_fp32, max_num_batched_tokens=256, enable_prefix_caching=False).generate(second, params)[0]
    assert fresh.num_cached_tokens == 0
    assert hit.outputs[0].token_ids == fresh.outputs[0].token_ids


def test_cpu_serving_dtype_runs_the_gguf_blocks_natively(gemma_path, gemma_fp32) -> None:
    """At the CPU serving dtype (bfloat16) every projection of the Q4_K_M file runs on the native block kernels
    (the Gemma weight view passes the GGUF block bytes through), and its logits stay close to float32's."""
    from edgeserve.kernels.cpu import native as cpu_native
    from edgeserve.kernels.cpu.native import BlockWeight
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    if cpu_native.library() is None:
        pytest.skip("native CPU kernels not built here")
    lm = load_model(resolve(str(gemma_path)), dtype="bfloat16")
    for layer in lm.model.layers:
        assert all(isinstance(w, BlockWeight) for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
    ids = lm.tokenizer.encode(PROMPTS[0])
    native = paged_logits(lm, ids, len(ids), 1)[0].float()
    ref = paged_logits(gemma_fp32, ids, len(ids), 1)[0].float()
    assert torch.nn.functional.cosine_similarity(native, ref, dim=0) > 0.99
    top2 = ref.topk(2).values
    if top2[0] - top2[1] > 1.0:  # no near-tie at the top: both pick the same token
        assert native.argmax() == ref.argmax()
