"""Decoder models that embed: a tiny GGUF whose metadata names a pooling (`llama.pooling_type`) serves
/v1/embeddings and /api/embed through the EmbeddingEngine (batched, padded, no KV cache), pooled per its metadata
and normalized; a decoder without it gets a 400 naming the model; /api/show reports the capabilities."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F

from edgeserve.server import ServerConfig
from edgeserve.engine.config import EngineConfig
from server_helpers import serve
from tiny_gguf import write_tiny_llama

TEXTS = ["hello", "hello world, a longer input with more tokens in it", "ll", "héllo wörld"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("decemb")
    return {"mean": write_tiny_llama(d / "meanpool.gguf", pooling_type=1),
            "last": write_tiny_llama(d / "lastpool.gguf", pooling_type=3, seed=1),
            "plain": write_tiny_llama(d / "plain.gguf")}


@pytest.fixture(scope="module")
def server(paths):
    # float32, as the reference below computes (the CPU default is bf16)
    with serve(ServerConfig(engine=EngineConfig(kv_cache_gb=0.01),
                            models=tuple(str(p) for p in paths.values()), keep_alive=None,
                            dtype="float32")) as s:
        yield s


def _reference(path, texts: list[str], pooling: str) -> tuple[np.ndarray, int]:
    """Each text alone through the decoder's ordinary single-sequence attention (ContiguousKV), pooled, normalized;
    and the number of tokens."""
    from edgeserve.models.attention import ContiguousKV
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    lm = load_model(resolve(str(path)), dtype="float32")
    c = lm.config
    out, n = [], 0
    for text in texts:
        ids = lm.tokenizer.encode(text, add_special_tokens=True)
        n += len(ids)
        kv = ContiguousKV(c.num_layers, len(ids), c.num_kv_heads, c.head_dim, torch.float32)
        h = lm.model.forward(torch.tensor(ids), torch.arange(len(ids)), kv).float()
        v = h.mean(0) if pooling == "mean" else h[-1]
        out.append(F.normalize(v, dim=-1).numpy())
    return np.stack(out), n


@pytest.mark.parametrize("name, pooling", [("meanpool", "mean"), ("lastpool", "last")])
def test_embeddings_match_single_sequence_forward(server, paths, name, pooling):
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    r = oai.embeddings.create(model=name, input=TEXTS)  # one padded batch of different lengths
    got = np.array([d.embedding for d in r.data], dtype=np.float32)
    ref, n_tokens = _reference(paths["mean" if pooling == "mean" else "last"], TEXTS, pooling)
    assert got.shape == (len(TEXTS), 32)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(got, ref, atol=2e-4)
    assert r.usage.prompt_tokens == n_tokens
    with httpx.Client(base_url=server.url, timeout=60) as c:
        ollama = c.post("/api/embed", json={"model": name, "input": TEXTS[:2], "dimensions": 8}).json()
    short = np.array(ollama["embeddings"])
    assert short.shape == (2, 8)
    np.testing.assert_allclose(np.linalg.norm(short, axis=1), 1.0, atol=1e-5)  # re-normalized after cutting


def test_decoder_without_pooling_is_400_naming_it(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        oa = c.post("/v1/embeddings", json={"model": "plain", "input": "hi"})
        ol = c.post("/api/embed", json={"model": "plain", "input": "hi"})
        gen = c.post("/v1/chat/completions", json={"model": "meanpool", "max_tokens": 2,
                                                   "messages": [{"role": "user", "content": "hi"}]})
    assert oa.status_code == 400 and "'plain'" in oa.json()["error"]["message"]
    assert "pooling" in oa.json()["error"]["message"] and oa.json()["error"]["param"] == "model"
    assert ol.status_code == 400 and "'plain'" in ol.json()["error"]
    assert gen.status_code == 400 and "embedding model" in gen.json()["error"]["message"]


def test_show_capabilities(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        pooled = c.post("/api/show", json={"model": "meanpool"}).json()
        plain = c.post("/api/show", json={"model": "plain"}).json()
    assert pooled["capabilities"] == ["embedding"]
    assert plain["capabilities"] == ["completion"]
