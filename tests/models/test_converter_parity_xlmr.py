"""Converter parity for XLM-RoBERTa encoders (issue 54): the bge-m3 embedder (XLMRobertaModel, CLS pooling, normalized)
and the bge-reranker-v2-m3 cross-encoder (XLMRobertaForSequenceClassification), as tiny random checkpoints with a
small SentencePiece Unigram vocabulary of XLM-R's kind (nmt_nfkc normalization, precompiled charsmap; XLM-R's real
250002-token one, tests/xlmr_vocab.py, takes a minute to convert and load here: the encoders beside llama-server
benchmark uses it), saved as the real folders are (`sentencepiece.bpe.model`, tokenizer.json; the embedder with
sentence-transformers pooling files, the reranker without, as BAAI publishes it), converted by llama.cpp's own
convert_hf_to_gguf.py to f32, loaded by edgeserve from the GGUF and from the folder, tokenized as the folder's
tokenizer does and computing as transformers float32 does (embeddings: the served pooled and normalized vectors;
reranker: the head's score of each (query, document) pair)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from converter_parity import convert  # noqa: E402
from encoder_gguf import train_unigram  # noqa: E402
from xlmr_vocab import xlmr_tokenizer_folder  # noqa: E402

TEXTS = ["The cat sits on the mat.", "Héllo wörld, naïve café ① ﬁ", "東京は日本の首都です。", "Привет, как дела?", "a"]
QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "Berlin ist die Hauptstadt.", "巴黎是法国的首都。", "ok"]


CORPUS = [f"{a} {b}" for a in ("The cat sits on the mat.", "Héllo wörld, naïve café déjà vu", "Привет, как дела?",
                               "東京は日本の首都です。北京", "What is the capital of France? Paris.")
          for b in ("sentence about rivers and mountains", "numbers 12345 and 3+4=7", "ok")] * 20


@pytest.fixture(scope="module")
def xlmr_tokenizer(tmp_path_factory) -> Path:
    return xlmr_tokenizer_folder(tmp_path_factory.mktemp("xlmr-tok"), train_unigram(CORPUS, vocab_size=300))


def tiny_xlmr(kind: str, tokenizer: Path, dest: Path):
    """A random 2-layer XLM-R of `kind` ("embed": XLMRobertaModel with CLS pooling + Normalize, as bge-m3; "rerank":
    XLMRobertaForSequenceClassification with one label, as bge-reranker-v2-m3) saved at `dest`; returns the model."""
    import shutil

    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification, XLMRobertaModel

    import sentencepiece

    spm = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer / "sentencepiece.bpe.model"))
    pieces = spm.get_piece_size()
    torch.manual_seed(1 if kind == "rerank" else 0)
    cfg = XLMRobertaConfig(vocab_size=pieces + 2, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=66, type_vocab_size=1, layer_norm_eps=1e-5,
                           pad_token_id=1, bos_token_id=0, eos_token_id=2, num_labels=1)
    if kind == "rerank":
        model = XLMRobertaForSequenceClassification(cfg)
    else:
        model = XLMRobertaModel(cfg, add_pooling_layer=False)
    model = model.float().eval()
    with torch.no_grad():  # far from the init, so every part matters
        for name, p in model.named_parameters():
            p.normal_(1.0 if "LayerNorm.weight" in name else 0.0, 0.3 if p.dim() == 1 else 0.15)
            if name.startswith("classifier."):  # scores a few units apart
                p.mul_(5.0)
    model.save_pretrained(dest)
    for f in tokenizer.iterdir():
        shutil.copy(f, dest / f.name)
    if kind == "embed":
        (dest / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
        (dest / "1_Pooling").mkdir()
        (dest / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": 32, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    return model


def _load(path: Path):
    from edgeserve.models.encoders.embedders import load_embedding_model
    from edgeserve.registry.resolve import resolve

    return load_embedding_model(resolve(str(path), pull_missing=False), dtype="float32")


@pytest.fixture(scope="module")
def embedder(tmp_path_factory, xlmr_tokenizer):
    d = tmp_path_factory.mktemp("bge-m3")
    model = tiny_xlmr("embed", xlmr_tokenizer, d / "folder")
    return model, d / "folder", convert(d / "folder", d / "bge-m3.f32.gguf")


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, xlmr_tokenizer):
    d = tmp_path_factory.mktemp("bge-reranker")
    model = tiny_xlmr("rerank", xlmr_tokenizer, d / "folder")
    return model, d / "folder", convert(d / "folder", d / "bge-reranker.f32.gguf")


@pytest.mark.parametrize("source", ["gguf", "folder"])
def test_converted_xlmr_embeds_as_transformers(embedder, source):
    from transformers import AutoTokenizer

    model, folder, gguf = embedder
    lm = _load(gguf if source == "gguf" else folder)
    assert lm.config.pooling == "cls" and lm.config.normalize and not getattr(lm, "is_reranker", False)
    tok = AutoTokenizer.from_pretrained(str(folder))
    seqs = [lm.encode(t)[0] for t in TEXTS]
    assert seqs == [tok(t).input_ids for t in TEXTS]
    got = lm.embed(seqs)  # one padded batch of different lengths
    with torch.no_grad():
        want = torch.stack([F.normalize(model(input_ids=torch.tensor([ids])).last_hidden_state[0, 0], dim=-1)
                            for ids in seqs])
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("source", ["gguf", "folder"])
def test_converted_xlmr_reranker_scores_as_transformers(reranker, source):
    """The converter writes no pooling type for a sequence classifier without sentence-transformers files: the
    classification head makes the GGUF a reranker (llama-server needs `--reranking` for it)."""
    from transformers import AutoTokenizer

    from edgeserve.loaders.gguf_file import GGUFFile
    from edgeserve.models.encoders.embedders import gguf_kind
    from edgeserve.registry.resolve import resolve
    from edgeserve.server.model_details import model_facts

    model, folder, gguf = reranker
    g = GGUFFile(gguf)
    assert "bert.pooling_type" not in g.metadata and gguf_kind(g.metadata, g.tensor_names()) == "rerank"
    assert model_facts(resolve(str(gguf), pull_missing=False)).capabilities == ["rerank"]
    lm = _load(gguf if source == "gguf" else folder)
    assert lm.is_reranker and lm.output_dim == 1
    tok = AutoTokenizer.from_pretrained(str(folder))
    pairs = [lm.encode_pair(QUERY, d)[0] for d in DOCS]
    assert pairs == [tok(QUERY, d).input_ids for d in DOCS]
    got = lm.embed(pairs)[:, 0]
    with torch.no_grad():
        want = torch.stack([model(input_ids=torch.tensor([ids])).logits[0, 0] for ids in pairs])
    assert want.std() > 0.1  # the scores differ, so a wrong head or pairing shows
    assert (got - want).abs().max().item() < 1e-5
