"""Reranking: cross-encoders from GGUF (`bert` with pooling type rank and a `cls` head, BERT- and XLM-RoBERTa-style
heads) and from a Hugging Face BertForSequenceClassification folder score (query, document) pairs as transformers /
sentence-transformers' CrossEncoder do, through POST /v1/rerank, /rerank and /v1/reranking (Jina / Cohere shapes:
`top_n`, `return_documents`, documents as strings or {text}); bad input is a 400 naming the field."""

from __future__ import annotations

import shutil

import httpx
import numpy as np
import pytest
import torch

from edgeserve.engine.config import EngineConfig
from edgeserve.server import ServerConfig
from encoder_gguf import minilm_vocab, write_encoder_gguf
from server_helpers import serve
from tiny_gguf import write_tiny_llama

QUERY = "Where do cats like to sleep?"
DOCS = ["Cats sleep on warm mats in the sun.", "The stock market fell on Tuesday.", "Héllo wörld, 東京 🤖",
        "Dogs and cats are pets that often nap on sofas and beds around the house.", "x"]
SHAPE = dict(hidden=32, layers=2, heads=4, ffn=64)


def _bert_classifier(seed: int):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=512, num_labels=1)
    return BertForSequenceClassification(cfg).eval()


def _xlmr_classifier(seed: int):
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification

    torch.manual_seed(seed)
    cfg = XLMRobertaConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=514, type_vocab_size=1, pad_token_id=0,
                           num_labels=1)
    return XLMRobertaForSequenceClassification(cfg).eval()


def _bert_gguf(path, model, vocab):
    """BertForSequenceClassification as a `bert` GGUF with pooling type rank: the pooler as `cls`, the
    classifier as `cls.output`."""
    sd = {k.removeprefix("bert."): v for k, v in model.state_dict().items()}
    rename = {"pooler.dense.weight": "cls.weight", "pooler.dense.bias": "cls.bias",
              "classifier.weight": "cls.output.weight", "classifier.bias": "cls.output.bias"}
    return write_encoder_gguf(path, "bert", sd, vocab, context=512, pooling_type=4, rename=rename, **SHAPE)


def _xlmr_gguf(path, model, vocab):
    """XLMRobertaForSequenceClassification as llama.cpp converts it: positions from 0 (the first pad_token_id + 1
    rows cut), classifier.dense / out_proj as `cls` / `cls.output`, one token type."""
    sd = {k.removeprefix("roberta."): v for k, v in model.state_dict().items()}
    sd["embeddings.position_embeddings.weight"] = sd["embeddings.position_embeddings.weight"][1:]
    return write_encoder_gguf(path, "bert", sd, vocab, context=512, pooling_type=4, type_vocab=1, **SHAPE)


def _qwen3_reranker_folder(folder, seed: int, logit_score: bool):
    """A tiny random Qwen3ForCausalLM folder published as a yes/no reranker: with a sentence-transformers
    LogitScore module naming the answer token ids, or (without one) by its name and "yes" / "no" tokens."""
    import json

    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tiny_gguf import byte_vocab

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + byte_vocab() + ["yes", "no"])}
    tok = tokenizers.Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=8, max_position_embeddings=1024, tie_word_embeddings=True)).eval()
    model.save_pretrained(folder)
    ids = (vocab["no"], vocab["yes"])
    if logit_score:
        ids = (vocab["n"], vocab["y"])  # the module's ids win over the tokenizer's words
        (folder / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.Transformer"},
            {"idx": 1, "name": "1", "path": "1_LogitScore",
             "type": "sentence_transformers.cross_encoder.modules.LogitScore"}]))
        (folder / "1_LogitScore").mkdir()
        (folder / "1_LogitScore" / "config.json").write_text(json.dumps({"true_token_id": ids[1],
                                                                         "false_token_id": ids[0]}))
    return model, tok, ids, folder


@pytest.fixture(scope="module")
def models(minilm, tmp_path_factory):
    d = tmp_path_factory.mktemp("rerank")
    vocab = minilm_vocab(minilm)
    bert, xlmr = _bert_classifier(1), _xlmr_classifier(2)
    folder, xlmr_folder = d / "ce-folder", d / "xlmr-ce"
    bert.save_pretrained(folder)
    xlmr.save_pretrained(xlmr_folder)  # (a WordPiece tokenizer: the same ids go to both sides)
    for f in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(minilm / f, folder / f)
        shutil.copy(minilm / f, xlmr_folder / f)
    from transformers import BertModel

    torch.manual_seed(3)
    embedder = BertModel(bert.config, add_pooling_layer=False).eval()
    head = np.random.default_rng(7).normal(0, 0.3, size=(2, 32)).astype(np.float32)
    qwen3 = write_tiny_llama(d / "qwen3-rank.gguf", arch="qwen3", pooling_type=4, context=1024,
                             extra_tensors={"cls.output.weight": head},
                             extra_metadata={"qwen3.classifier.output_labels": ["yes", "no"]})
    qwen3_st = _qwen3_reranker_folder(d / "qwen3-st-rank", 4, logit_score=True)
    qwen3_named = _qwen3_reranker_folder(d / "Tiny-Qwen3-Reranker", 5, logit_score=False)
    return {"qwen3": (head, qwen3), "qwen3-st": (qwen3_st, qwen3_st[3]), "qwen3-named": (qwen3_named, qwen3_named[3]),
            "bert": (bert, _bert_gguf(d / "bert-rank.gguf", bert, vocab)),
            "xlmr": (xlmr, _xlmr_gguf(d / "xlmr-rank.gguf", xlmr, vocab)), "folder": (bert, folder),
            "xlmr-folder": (xlmr, xlmr_folder),
            "embed": (None, write_encoder_gguf(d / "embed.gguf", "bert", embedder.state_dict(), vocab, context=512,
                                               pooling_type=1, **SHAPE))}


@pytest.fixture(scope="module")
def server(models):
    with serve(ServerConfig(engine=EngineConfig(kv_cache_gb=0.01), models=tuple(str(p) for _, p in models.values()),
                            keep_alive=None, dtype="float32")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _reference(model, minilm_tokenizer, with_types: bool) -> np.ndarray:
    """sigmoid(logit) of each (QUERY, doc) pair, one pair at a time through transformers."""
    out = []
    with torch.no_grad():
        for doc in DOCS:
            enc = minilm_tokenizer.encode(QUERY, doc)
            types = torch.tensor([enc.type_ids]) if with_types else torch.zeros(1, len(enc.ids), dtype=torch.long)
            logit = model(input_ids=torch.tensor([enc.ids]), token_type_ids=types).logits[0, 0]
            out.append(torch.sigmoid(logit).item())
    return np.array(out)


@pytest.mark.parametrize("name, model_id, with_types", [("bert", "bert-rank", True), ("xlmr", "xlmr-rank", False),
                                                         ("folder", "ce-folder", True),
                                                         ("xlmr-folder", "xlmr-ce", False)])
def test_scores_match_transformers(client, models, minilm_tokenizer, name, model_id, with_types):
    r = client.post("/v1/rerank", json={"model": model_id, "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    want = _reference(models[name][0], minilm_tokenizer, with_types)
    got = {x["index"]: x["relevance_score"] for x in body["results"]}
    assert sorted(got) == list(range(len(DOCS)))
    np.testing.assert_allclose([got[i] for i in range(len(DOCS))], want, atol=1e-5)
    assert [x["index"] for x in body["results"]] == list(np.argsort(-want, kind="stable"))  # best first
    assert body["model"] == model_id and body["usage"]["total_tokens"] > 0


def test_folder_matches_sentence_transformers_cross_encoder(client, models):
    st = pytest.importorskip("sentence_transformers")
    ce = st.CrossEncoder(str(models["folder"][1]), device="cpu")
    want = ce.predict([(QUERY, d) for d in DOCS])
    got = client.post("/rerank", json={"model": "ce-folder", "query": QUERY, "documents": DOCS}).json()["results"]
    np.testing.assert_allclose([x["relevance_score"] for x in sorted(got, key=lambda x: x["index"])], want,
                               atol=1e-5)


def _qwen3_reference(path, head: np.ndarray) -> np.ndarray:
    """Qwen3-Reranker's score of each (QUERY, doc): the prompt alone through the decoder's single-sequence
    attention, the last state times the (yes, no) rows, softmax -> P(yes)."""
    from edgeserve.models.attention import ContiguousKV
    from edgeserve.models.encoders.decoder_rerank import INSTRUCTION, PREFIX, SUFFIX
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    lm = load_model(resolve(str(path)), dtype="float32")
    c = lm.config
    out = []
    for doc in DOCS:
        text = f"{PREFIX}<Instruct>: {INSTRUCTION}\n<Query>: {QUERY}\n<Document>: {doc}{SUFFIX}"
        ids = lm.tokenizer.encode(text, add_special_tokens=False)
        kv = ContiguousKV(c.num_layers, len(ids), c.num_kv_heads, c.head_dim, torch.float32)
        h = lm.model.forward(torch.tensor(ids), torch.arange(len(ids)), kv).float()[-1]
        yes, no = (torch.from_numpy(head) @ h).tolist()
        out.append(torch.softmax(torch.tensor([no, yes]), 0)[1].item())
    return np.array(out)


def test_qwen3_reranker_gguf(client, models):
    head, path = models["qwen3"]
    r = client.post("/v1/rerank", json={"model": "qwen3-rank", "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    want = _qwen3_reference(path, head)
    np.testing.assert_allclose([got[i] for i in range(len(DOCS))], want, atol=1e-5)
    long = client.post("/v1/rerank", json={"model": "qwen3-rank", "query": QUERY, "documents": ["word " * 900]})
    assert long.status_code == 200, long.text
    strict = client.post("/v1/rerank", json={"model": "qwen3-rank", "query": QUERY, "documents": ["word " * 900],
                                             "truncate": False})
    assert strict.status_code == 400 and strict.json()["error"]["param"] == "documents[0]"
    assert client.post("/v1/embeddings", json={"model": "qwen3-rank", "input": "hi"}).status_code == 400


def _qwen3_folder_reference(model, tok, ids) -> np.ndarray:
    """Qwen3-Reranker's published scoring in transformers: the prompt through the causal LM, the last position's
    logits of ("no", "yes"), softmax -> P(yes)."""
    from edgeserve.models.encoders.decoder_rerank import INSTRUCTION, PREFIX, SUFFIX

    out = []
    with torch.no_grad():
        for doc in DOCS:
            text = f"{PREFIX}<Instruct>: {INSTRUCTION}\n<Query>: {QUERY}\n<Document>: {doc}{SUFFIX}"
            logits = model(input_ids=torch.tensor([tok.encode(text, add_special_tokens=False).ids])).logits[0, -1]
            out.append(torch.softmax(logits[list(ids)], 0)[1].item())
    return np.array(out)


@pytest.mark.parametrize("name, model_id", [("qwen3-st", "qwen3-st-rank"), ("qwen3-named", "Tiny-Qwen3-Reranker")])
def test_qwen3_reranker_folder_matches_transformers(client, models, name, model_id):
    """A Qwen3-Reranker Hugging Face folder (sentence-transformers' LogitScore module, or the folder's name) scores
    as its published recipe does in transformers, batched with padding."""
    model, tok, ids, _ = models[name][0]
    r = client.post("/v1/rerank", json={"model": model_id, "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    np.testing.assert_allclose([got[i] for i in range(len(DOCS))], _qwen3_folder_reference(model, tok, ids),
                               atol=1e-5)
    assert client.post("/v1/embeddings", json={"model": model_id, "input": "hi"}).status_code == 400


def test_top_n_return_documents_and_object_documents(client):
    docs = [{"text": d} for d in DOCS]
    for path in ("/v1/rerank", "/rerank", "/v1/reranking", "/reranking"):
        r = client.post(path, json={"model": "xlmr-rank", "query": QUERY, "documents": docs, "top_n": 2,
                                    "return_documents": True})
        assert r.status_code == 200, (path, r.text)
        results = r.json()["results"]
        assert len(results) == 2 and results[0]["relevance_score"] >= results[1]["relevance_score"]
        assert all(x["document"] == {"text": DOCS[x["index"]]} for x in results)
    plain = client.post("/v1/rerank", json={"model": "xlmr-rank", "query": QUERY, "documents": DOCS,
                                            "top_n": 100}).json()["results"]
    assert len(plain) == len(DOCS) and all("document" not in x for x in plain)


def test_cohere_v2_rerank_shape(client):
    # cohere's ClientV2.rerank: POST /v2/rerank with string documents, top_n and max_tokens_per_doc
    r = client.post("/v2/rerank", json={"model": "xlmr-rank", "query": QUERY, "documents": DOCS, "top_n": 2,
                                        "max_tokens_per_doc": 512})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["meta"]["api_version"]["version"] == "2" and body["meta"]["billed_units"]["search_units"] == 1
    _same_as_v1(client, body["results"])
    bad = client.post("/v2/rerank", json={"model": "xlmr-rank", "query": QUERY, "documents": []})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "documents"


def _same_as_v1(client, results: list) -> None:
    v1 = client.post("/v1/rerank", json={"model": "xlmr-rank", "query": QUERY, "documents": DOCS}).json()["results"]
    assert [x["index"] for x in results] == [x["index"] for x in v1[:2]]
    assert results[0]["relevance_score"] == pytest.approx(v1[0]["relevance_score"], abs=1e-6)


def test_cohere_client_v2_rerank(client):
    """The real cohere client (ClientV2.rerank, issue 52 item 2) against /v2/rerank; its 400 as cohere's error."""
    cohere = pytest.importorskip("cohere")
    co = cohere.ClientV2(api_key="unused", base_url=str(client.base_url))
    got = co.rerank(model="xlmr-rank", query=QUERY, documents=DOCS, top_n=2, max_tokens_per_doc=512)
    _same_as_v1(client, [{"index": x.index, "relevance_score": x.relevance_score} for x in got.results])
    with pytest.raises(cohere.BadRequestError) as e:
        co.rerank(model="xlmr-rank", query=QUERY, documents=[])
    assert e.value.status_code == 400 and e.value.body["error"]["param"] == "documents"


@pytest.mark.parametrize("body, param", [
    ({"query": QUERY, "documents": DOCS}, "model"),
    ({"model": "xlmr-rank", "documents": DOCS}, "query"),
    ({"model": "xlmr-rank", "query": "", "documents": DOCS}, "query"),
    ({"model": "xlmr-rank", "query": QUERY, "documents": []}, "documents"),
    ({"model": "xlmr-rank", "query": QUERY, "documents": ["d"] * 2049}, "documents"),
    ({"model": "xlmr-rank", "query": QUERY, "documents": "just one"}, "documents"),
    ({"model": "xlmr-rank", "query": QUERY, "documents": ["a", {"txt": "b"}]}, "documents[1]"),
    ({"model": "xlmr-rank", "query": QUERY, "documents": ["a", ""]}, "documents[1]"),
    ({"model": "xlmr-rank", "query": QUERY, "documents": DOCS, "top_n": 0}, "top_n"),
    ({"model": "xlmr-rank", "query": QUERY, "documents": DOCS, "top_n": "2"}, "top_n"),
    ({"model": "xlmr-rank", "query": QUERY, "documents": DOCS, "return_documents": "yes"}, "return_documents"),
    ({"model": "xlmr-rank", "query": QUERY, "documents": ["ok", "word " * 600], "truncate": False}, "documents[1]"),
    ({"model": "embed", "query": QUERY, "documents": DOCS}, "model"),
])
def test_bad_requests_are_400_naming_the_field(client, body, param):
    r = client.post("/v1/rerank", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_long_document_truncated_by_default_and_embeddings_refused(client):
    r = client.post("/v1/rerank", json={"model": "xlmr-rank", "query": QUERY, "documents": ["word " * 600, "ok"]})
    assert r.status_code == 200 and len(r.json()["results"]) == 2
    e = client.post("/v1/embeddings", json={"model": "xlmr-rank", "input": "hi"})
    assert e.status_code == 400 and "reranker" in e.json()["error"]["message"]
    ok = client.post("/v1/embeddings", json={"model": "embed", "input": "hi"})
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 32


def test_score_route(client, models, minilm_tokenizer):
    """vLLM's /v1/score: one text_1 against each text_2, or pairwise lists; the rerank scores, in input order."""
    want = _reference(models["bert"][0], minilm_tokenizer, True)
    one = client.post("/v1/score", json={"model": "bert-rank", "text_1": QUERY, "text_2": DOCS})
    assert one.status_code == 200, one.text
    data = one.json()["data"]
    assert [d["index"] for d in data] == list(range(len(DOCS))) and all(d["object"] == "score" for d in data)
    np.testing.assert_allclose([d["score"] for d in data], want, atol=1e-5)
    pairwise = client.post("/v1/score", json={"model": "bert-rank", "text_1": [QUERY] * 2, "text_2": DOCS[:2]})
    np.testing.assert_allclose([d["score"] for d in pairwise.json()["data"]], want[:2], atol=1e-5)
    for body, param in (({"text_1": ["a", "b"], "text_2": DOCS}, "text_1"), ({"text_1": QUERY, "text_2": []}, "text_2"),
                        ({"text_1": QUERY, "text_2": ["ok", 3]}, "text_2[1]"), ({"text_2": DOCS}, "text_1")):
        r = client.post("/v1/score", json={"model": "bert-rank", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_capabilities_mark_rerankers_and_embedders(client):
    """/api/show, /v1/models and /api/tags say which models rerank (encoder and decoder rerankers, GGUF and folder)
    and which embed."""
    want = {"bert-rank": ["rerank"], "xlmr-rank": ["rerank"], "ce-folder": ["rerank"], "xlmr-ce": ["rerank"],
            "qwen3-rank": ["rerank"], "qwen3-st-rank": ["rerank"], "Tiny-Qwen3-Reranker": ["rerank"],
            "embed": ["embedding"]}
    for name, caps in want.items():
        assert client.post("/api/show", json={"model": name}).json()["capabilities"] == caps, name
    listed = {m["id"]: m["capabilities"] for m in client.get("/v1/models").json()["data"] if m["id"] in want}
    tags = {m["name"]: m["capabilities"] for m in client.get("/api/tags").json()["models"] if m["name"] in want}
    assert listed == want, listed
    assert tags == want, tags
