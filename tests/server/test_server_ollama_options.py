"""Ollama's documented runtime options through ollama-python's Options: accepted, applied where they map onto the
sampler (repeat_last_n, typical_p), checked and ignored where they do not; only unknown names and bad values 400."""

from __future__ import annotations

import math

import httpx
import ollama
import pytest
import torch

from edgeserve.engine.runner.sampler import apply_penalties, apply_typical
from edgeserve.sampling_params import SamplingParams
from server_helpers import serve_tiny

HARDWARE = dict(num_thread=2, num_gpu=1, main_gpu=0, num_batch=8, num_keep=4, use_mmap=True, use_mlock=False,
                numa=False, low_vram=False, vocab_only=False, f16_kv=True, tfs_z=1.0, mirostat=0, mirostat_eta=0.1,
                mirostat_tau=5.0, penalize_newline=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve_tiny(tmp_path_factory.mktemp("ollama_opts")) as s:
        yield s


def test_every_documented_option_is_accepted_through_the_client(server):
    client = ollama.Client(host=server.url)
    options = ollama.Options(**HARDWARE, typical_p=0.9, repeat_last_n=64, repeat_penalty=1.1, num_predict=4,
                             temperature=0.7, seed=3, num_ctx=256, logits_all=False, embedding_only=False)
    reply = client.chat(model="tiny", messages=[{"role": "user", "content": "hello"}], options=options)
    assert reply.done and reply.eval_count == 4
    gen = client.generate(model="tiny", prompt="hello", options=ollama.Options(**HARDWARE, num_predict=3))
    assert gen.done and gen.eval_count == 3


@pytest.mark.parametrize("option,value", [("num_thread", "two"), ("num_gpu", 1.5), ("use_mmap", "yes"),
                                          ("mirostat", 3), ("typical_p", 0), ("repeat_last_n", -2),
                                          ("tfs_z", -1), ("penalize_newline", 1), ("bogus_option", 1)])
def test_bad_values_and_unknown_names_are_400(server, option, value):
    client = ollama.Client(host=server.url)
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="tiny", messages=[{"role": "user", "content": "x"}], options={option: value})
    assert e.value.status_code == 400 and f"options.{option}" in e.value.error


def _generate(server, **options) -> str:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/api/generate", json={"model": "tiny", "prompt": "the cat sat on the mat", "stream": False,
                                          "options": {"num_predict": 12, **options}})
    assert r.status_code == 200, r.text
    return r.json()["response"]


def test_typical_p_narrows_the_draw(server):
    # a typical_p this small keeps one token per step: different seeds at a high temperature agree
    outs = {_generate(server, temperature=1.5, seed=s, typical_p=1e-9) for s in (1, 2, 3)}
    assert len(outs) == 1
    assert len({_generate(server, temperature=1.5, seed=s) for s in (1, 2, 3)}) > 1


def test_repeat_last_n_zero_turns_the_penalty_off(server):
    plain = _generate(server, temperature=0)
    assert _generate(server, temperature=0, repeat_penalty=100, repeat_last_n=0) == plain


def test_penalty_window_counts_only_the_last_tokens():
    logits = torch.zeros(1, 8)
    logits[0, :] = 2.0
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, penalty_last_n=3)
    out = apply_penalties(logits, [params], [[1, 2, 3]], [[4, 5]])
    # the last 3 tokens are 3 (prompt), 4 and 5 (output): only they are penalized
    assert out[0].tolist() == [2.0, 2.0, 2.0, 1.0, 0.0, 0.0, 2.0, 2.0]
    everything = apply_penalties(logits, [SamplingParams(repetition_penalty=2.0)], [[1, 2, 3]], [[4, 5]])
    assert everything[0].tolist() == [2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 2.0]
    off = apply_penalties(logits, [SamplingParams(repetition_penalty=2.0, penalty_last_n=0)], [[1]], [[4]])
    assert off[0].tolist() == [2.0] * 8


def test_typical_keeps_tokens_nearest_the_entropy():
    # one likely token among a hundred unlikely ones: the entropy is high, so the unlikely ones are the typical ones
    logits = torch.tensor([[3.0] + [0.0] * 100])
    kept = apply_typical(logits, [SamplingParams(typical_p=0.5)])
    p_other = 1 / (math.exp(3.0) + 100)
    assert kept[0, 0] == float("-inf") and int(torch.isfinite(kept[0]).sum()) == math.ceil(0.5 / p_other)
    assert torch.equal(apply_typical(logits, [SamplingParams()]), logits)


def test_langchain_chat_ollama_with_runtime_options(server):
    langchain_ollama = pytest.importorskip("langchain_ollama")
    chat = langchain_ollama.ChatOllama(model="tiny", base_url=server.url, num_predict=4, num_gpu=1, num_thread=2,
                                       mirostat=0, mirostat_eta=0.1, mirostat_tau=5.0, repeat_last_n=64,
                                       tfs_z=1.0, temperature=0)
    reply = chat.invoke("hello")
    assert reply.response_metadata.get("done") is True and reply.usage_metadata["output_tokens"] == 4
