"""BERT-family encoders from GGUF (`bert`, `nomic-bert`) as llama.cpp's converter writes them: the WordPiece
tokenizer rebuilt from `tokenizer.ggml.*` equals Hugging Face's; tiny random models match transformers' BertModel /
a float64 nomic-bert reference from its published definition; the real all-MiniLM-L6-v2 converted to GGUF matches
sentence-transformers, also through /v1/embeddings and /api/embed."""

from __future__ import annotations


import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from edgeserve.engine.config import EngineConfig
from edgeserve.registry import resolve
from edgeserve.server import ServerConfig
from encoder_gguf import minilm_vocab, train_unigram, write_encoder_gguf, xlmr_ids
from encoder_references import jina_reference, jina_state, nomic_reference, nomic_state
from server_helpers import serve

TEXTS = [
    "The cat sits on the mat.",
    "Héllo wörld, naïve café déjà vu",
    "東京は日本の首都です。北京",
    "emoji 🤖🚀 and symbols: $5.00, 3+4=7 <tag> [x]",
    "UPPER lower MiXeD unbelievably antidisestablishmentarianism",
    " ".join(f"sentence {i} about rivers and mountains." for i in range(40)),
    "a",
]


def _tiny_bert(seed: int = 0):
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=512, type_vocab_size=2)
    return BertModel(cfg, add_pooling_layer=False).eval()


def _load(path):
    from edgeserve.models.encoders.gguf_encoder import load_gguf_encoder

    return load_gguf_encoder(resolve(str(path)), dtype="float32")


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_wordpiece_from_gguf_equals_hf(tmp_path, minilm, minilm_tokenizer):
    from edgeserve.loaders.gguf_file import GGUFFile
    from edgeserve.loaders.tokenizer import tokenizer_from_gguf

    path = write_encoder_gguf(tmp_path / "tok.gguf", "bert", _tiny_bert().state_dict(), minilm_vocab(minilm),
                              hidden=32, layers=2, heads=4, ffn=64, context=512, pooling_type=1)
    tok = tokenizer_from_gguf(GGUFFile(path).metadata).backend
    for text in TEXTS:
        assert tok.encode(text).ids == minilm_tokenizer.encode(text).ids, text
    pair = tok.encode(TEXTS[0], TEXTS[1])
    want = minilm_tokenizer.encode(TEXTS[0], TEXTS[1])
    assert pair.ids == want.ids and pair.type_ids == want.type_ids
    # an older file: [CLS] / [SEP] as cls_token_id / seperator_token_id only, BOS / EOS pointing elsewhere
    md = dict(GGUFFile(path).metadata)
    md.update({"tokenizer.ggml.cls_token_id": 101, "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 0})
    assert tokenizer_from_gguf(md).backend.encode(TEXTS[0]).ids == minilm_tokenizer.encode(TEXTS[0]).ids


@pytest.mark.parametrize("pooling_type, pool", [(1, "mean"), (2, "cls")])
def test_bert_gguf_matches_transformers(tmp_path, minilm, minilm_tokenizer, pooling_type, pool):
    model = _tiny_bert(seed=pooling_type)
    path = write_encoder_gguf(tmp_path / "bert.gguf", "bert", model.state_dict(), minilm_vocab(minilm), hidden=32,
                              layers=2, heads=4, ffn=64, context=512, pooling_type=pooling_type)
    lm = _load(path)
    assert (lm.config.pooling, lm.config.normalize, lm.config.max_seq_length) == (pool, True, 512)
    seqs = [lm.encode(t)[0] for t in TEXTS]
    got = lm.embed(seqs).numpy()  # one padded batch of different lengths
    want = []
    with torch.no_grad():
        for ids in seqs:
            h = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
            want.append(F.normalize(h.mean(0) if pool == "mean" else h[0], dim=-1).numpy())
    assert _cos(got, np.stack(want)).min() > 0.9999
    np.testing.assert_allclose(got, np.stack(want), atol=2e-5)


def test_nomic_bert_gguf_matches_reference(tmp_path, minilm):
    vocab = minilm_vocab(minilm)
    sd = nomic_state(32, 2, 48, len(vocab))
    path = write_encoder_gguf(tmp_path / "nomic.gguf", "nomic-bert", sd, vocab, hidden=32, layers=2, heads=4, ffn=48,
                              context=2048, pooling_type=1, rope_base=1000.0)
    lm = _load(path)
    assert lm.config.rope_theta == 1000.0 and lm.config.pooling == "mean"
    seqs = [lm.encode(t)[0] for t in TEXTS]
    got = lm.embed(seqs).numpy()
    want = np.stack([nomic_reference(sd, ids, 4, 2, 1000.0, 1e-12).numpy() for ids in seqs])
    assert _cos(got, want).min() > 0.9999
    np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.parametrize("heads, fused, qk_norm", [(4, False, False), (6, True, True)])
def test_jina_bert_v2_gguf_matches_reference(tmp_path, minilm, heads, fused, qk_norm):
    """jina-bert-v2 (no transformers implementation: JinaBert is remote code) against a float64 reference from its
    definition: a power-of-two head count and one that is not (ALiBi's interleaved slopes), the split and the fused
    GLU layouts, the optional query/key LayerNorms; the batch padded, so padding must not leak through ALiBi."""
    vocab = minilm_vocab(minilm)
    hidden, ffn = 8 * heads, 40
    sd = jina_state(hidden, 2, ffn, len(vocab), fused, qk_norm)
    path = write_encoder_gguf(tmp_path / "jina.gguf", "jina-bert-v2", sd, vocab, hidden=hidden, layers=2, heads=heads,
                              ffn=ffn, context=8192, pooling_type=1)
    lm = _load(path)
    assert lm.config.pooling == "mean" and lm.config.max_seq_length == 8192
    from edgeserve.models.encoders.embedders import is_embedding_source
    from edgeserve.server.model_details import model_facts

    assert is_embedding_source(resolve(str(path))) and model_facts(resolve(str(path))).capabilities == ["embedding"]
    seqs = [lm.encode(t)[0] for t in TEXTS]
    got = lm.embed(seqs).numpy()
    want = np.stack([jina_reference(sd, ids, heads, 2, ffn, 1e-12).numpy() for ids in seqs])
    assert _cos(got, want).min() > 0.9999
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_jina_alibi_attends_in_query_blocks(minilm, tmp_path, monkeypatch):
    """A long input attends in query blocks (the bias is never [seq, seq] whole) with the same states."""
    from edgeserve.models.encoders import jina_bert

    vocab = minilm_vocab(minilm)
    sd = jina_state(32, 1, 40, len(vocab), False, False)
    lm = _load(write_encoder_gguf(tmp_path / "jina.gguf", "jina-bert-v2", sd, vocab, hidden=32, layers=1, heads=4,
                                  ffn=40, context=8192, pooling_type=1))
    seqs = [lm.encode(TEXTS[5])[0]]
    whole = lm.embed(seqs)
    monkeypatch.setattr(jina_bert, "_MASK_BYTES", 4 * 4 * 7 * len(seqs[0]))  # 7 query rows per block
    np.testing.assert_allclose(lm.embed(seqs).numpy(), whole.numpy(), atol=1e-6)


@pytest.fixture(scope="module")
def minilm_gguf(minilm, tmp_path_factory):
    """The real all-MiniLM-L6-v2 safetensors converted to a `bert` GGUF (mean pooling), F32, F16 and Q8_0."""
    from safetensors.torch import load_file

    sd = load_file(str(minilm / "model.safetensors"))
    d = tmp_path_factory.mktemp("minilm")
    kw = dict(hidden=384, layers=6, heads=12, ffn=1536, context=512, pooling_type=1)
    return {q: write_encoder_gguf(d / f"minilm-{q.lower()}.gguf", "bert", sd, minilm_vocab(minilm), qtype=q, **kw)
            for q in ("F32", "F16", "Q8_0")}


@pytest.fixture(scope="module")
def st_reference(minilm):
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(minilm), device="cpu")
    model.max_seq_length = 512  # the GGUF's context_length is the model's 512 positions, not the folder's 256
    return model.encode(TEXTS, convert_to_numpy=True, normalize_embeddings=True)


def test_real_minilm_gguf_matches_sentence_transformers(minilm_gguf, st_reference):
    for qtype, min_cos in (("F32", 0.9999), ("F16", 0.999), ("Q8_0", 0.995)):
        lm = _load(minilm_gguf[qtype])
        got = lm.embed([lm.encode(t)[0] for t in TEXTS]).numpy()
        assert _cos(got, st_reference).min() > min_cos, qtype


def test_real_minilm_f16_in_bfloat16_matches_sentence_transformers(minilm_gguf, st_reference):
    """dtype auto: the F16 matrices multiply in bfloat16 (the native kernel where the CPU has AVX-512 BF16, torch
    where it has only other bfloat16 dots, float32 elsewhere), within the F16 file's bound."""
    from edgeserve.models.encoders.gguf_encoder import load_gguf_encoder

    lm = load_gguf_encoder(resolve(str(minilm_gguf["F16"])), dtype="auto")
    got = lm.embed([lm.encode(t)[0] for t in TEXTS]).numpy()
    assert _cos(got, st_reference).min() > 0.999


def test_gguf_encoder_served(minilm_gguf, st_reference):
    with serve(ServerConfig(engine=EngineConfig(kv_cache_gb=0.01), models=(str(minilm_gguf["F32"]),),
                            keep_alive=None, dtype="float32")) as s, httpx.Client(base_url=s.url, timeout=120) as c:
        oai = c.post("/v1/embeddings", json={"model": "minilm-f32", "input": TEXTS}).json()
        got = np.array([d["embedding"] for d in oai["data"]])
        short = c.post("/api/embed", json={"model": "minilm-f32", "input": TEXTS[:2], "dimensions": 64}).json()
        show = c.post("/api/show", json={"model": "minilm-f32"}).json()
    assert _cos(got, st_reference).min() > 0.9999
    assert np.allclose(np.linalg.norm(short["embeddings"], axis=1), 1.0, atol=1e-5)
    assert len(short["embeddings"][0]) == 64
    assert "embedding" in show["capabilities"]


CORPUS = [f"{a} {b}" for a in ("The cat sits on the mat.", "Héllo wörld, naïve café déjà vu", "Привет, как дела?",
                               "東京は日本の首都です。北京", "UPPER lower MiXeD ｆｕｌｌｗｉｄｔｈ")
          for b in ("sentence about rivers and mountains", "numbers 12345 and 3+4=7", "ok")] * 20


@pytest.fixture(scope="module")
def spm():
    """A small SentencePiece Unigram model (XLM-R's kind: nmt_nfkc normalization, a precompiled charsmap)."""
    return train_unigram(CORPUS, vocab_size=300)


def _tiny_xlmr(vocab_size: int, seed: int = 0):
    from transformers import XLMRobertaConfig, XLMRobertaModel

    torch.manual_seed(seed)
    cfg = XLMRobertaConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=514, type_vocab_size=1, pad_token_id=1)
    return XLMRobertaModel(cfg, add_pooling_layer=False).eval()


def _xlmr_gguf(path, model, spm: bytes, pooling_type: int):
    """XLMRobertaModel as llama.cpp's converter writes it: `bert` arch, positions from 0 (the first
    pad_token_id + 1 rows cut), one token type, the Unigram vocabulary (tokenizer model `t5`)."""
    sd = dict(model.state_dict())
    sd["embeddings.position_embeddings.weight"] = sd["embeddings.position_embeddings.weight"][2:]
    return write_encoder_gguf(path, "bert", sd, spm, hidden=32, layers=2, heads=4, ffn=64, context=512,
                              pooling_type=pooling_type, eps=1e-5, type_vocab=1)


def _sp_size(spm: bytes) -> int:
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_proto=spm).get_piece_size()


def test_unigram_from_gguf_equals_xlmr_tokenizer(tmp_path, spm):
    from edgeserve.loaders.gguf_file import GGUFFile
    from edgeserve.loaders.tokenizer import tokenizer_from_gguf

    path = _xlmr_gguf(tmp_path / "xlmr.gguf", _tiny_xlmr(_sp_size(spm) + 2), spm, 2)
    tok = tokenizer_from_gguf(GGUFFile(path).metadata).backend
    texts = TEXTS + ["ｆｕｌｌｗｉｄｔｈ and ① ligature ﬁ", "tabs\tand  double  spaces", CORPUS[7] * 30]
    for text in texts:
        assert tok.encode(text).ids == xlmr_ids(spm, text), text
    assert tok.encode(texts[0], texts[1]).ids == xlmr_ids(spm, texts[0], texts[1])


def test_xlmr_gguf_matches_transformers(tmp_path, spm):
    model = _tiny_xlmr(_sp_size(spm) + 2, seed=5)
    lm = _load(_xlmr_gguf(tmp_path / "xlmr.gguf", model, spm, 2))
    assert lm.config.pooling == "cls" and lm.config.type_vocab_size == 1
    seqs = [lm.encode(t)[0] for t in TEXTS]
    got = lm.embed(seqs).numpy()
    with torch.no_grad():
        want = np.stack([F.normalize(model(input_ids=torch.tensor([ids])).last_hidden_state[0, 0], dim=-1).numpy()
                         for ids in seqs])
    assert _cos(got, want).min() > 0.9999
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_roberta_bpe_gguf_matches_transformers(tmp_path):
    """A RoBERTa encoder with a byte-level BPE vocabulary (granite-embedding's kind): `<s> A </s>` from the file's
    add_* flags (its tokenizer has no template of its own), positions after the padding id."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, processors
    from transformers import RobertaConfig, RobertaModel

    from tiny_gguf import byte_vocab

    tokens = ["<s>", "<pad>", "</s>", "<unk>"] + byte_vocab() + ["he", "ll", "hell"]
    merges = ["h e", "l l", "he ll"]
    torch.manual_seed(3)
    model = RobertaModel(RobertaConfig(vocab_size=len(tokens), hidden_size=32, num_hidden_layers=2,
                                       num_attention_heads=4, intermediate_size=64, max_position_embeddings=130,
                                       type_vocab_size=1, pad_token_id=1), add_pooling_layer=False).eval()
    sd = dict(model.state_dict())
    sd["embeddings.position_embeddings.weight"] = sd["embeddings.position_embeddings.weight"][2:]
    path = write_encoder_gguf(tmp_path / "roberta.gguf", "bert", sd, tokens, hidden=32, layers=2, heads=4, ffn=64,
                              context=128, pooling_type=1, eps=1e-12, type_vocab=1, bpe_merges=merges)
    ref = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split()) for m in merges]))
    ref.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    ref.decoder = decoders.ByteLevel()
    ref.add_special_tokens(tokens[:4])
    ref.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), add_prefix_space=False)
    lm = _load(path)
    texts = ["hello world", "héllo 🤖 hell", "a"]
    seqs = [lm.encode(t)[0] for t in texts]
    assert seqs == [ref.encode(t).ids for t in texts]
    got = lm.embed(seqs).numpy()
    with torch.no_grad():
        want = np.stack([F.normalize(model(input_ids=torch.tensor([ids])).last_hidden_state[0].mean(0), dim=-1)
                         .numpy() for ids in seqs])
    np.testing.assert_allclose(got, want, atol=2e-5)
