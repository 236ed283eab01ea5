"""EmbeddingGemma from GGUF (`gemma-embedding`, as llama.cpp's converter writes it): a tiny random transformers
Gemma3TextModel with bidirectional attention (sliding layers: half the window on either side) written as a GGUF
with its dense_2 / dense_3 projections; edgeserve's padded batch equals transformers' per-text mean pooling ->
dense -> dense -> L2 normalize (sentence-transformers' EmbeddingGemma modules), also through /v1/embeddings."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from edgeserve.engine.config import EngineConfig
from edgeserve.registry import resolve
from edgeserve.server import ServerConfig
from server_helpers import serve
from support.gguf_vocab import byte_vocab
from support.gguf_writer import finish

WINDOW = 8  # sliding layers see keys at most 4 positions away; texts below run past it
TOKENS = ["<pad>", "<eos>", "<bos>"] + byte_vocab() + ["he", "ll"]


def _tiny_gemma(seed: int = 0):
    from transformers import Gemma3TextConfig, Gemma3TextModel

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=len(TOKENS), hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=WINDOW,
                           max_position_embeddings=256, use_bidirectional_attention=True, query_pre_attn_scalar=8,
                           rope_theta=1e6, pad_token_id=0, bos_token_id=2, eos_token_id=1)
    model = Gemma3TextModel(cfg).eval()
    with torch.no_grad():  # random norm weights, so that a missing or doubled +1 shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    return model


def _write_gguf(path, model, dense: list[torch.Tensor]) -> None:
    """The model as llama.cpp's Gemma3 converter writes it (norm weights stored as 1 + w, arch gemma-embedding)."""
    import gguf

    c = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA_EMBEDDING, c.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), "gemma-embedding")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(1e6)
    w.add_sliding_window(WINDOW)
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType.MEAN)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * 258)
    w.add_token_merges(["h e", "l l"])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)
    w.add_add_eos_token(True)
    for hf_name, t in model.state_dict().items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        data = t.float().numpy()
        w.add_tensor(name, data + 1.0 if "norm" in hf_name else data)
    w.add_tensor("dense_2.weight", dense[0].numpy())
    w.add_tensor("dense_3.weight", dense[1].numpy())
    finish(w)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    model = _tiny_gemma()
    g = torch.Generator().manual_seed(1)
    dense = [torch.randn(96, 32, generator=g) * 0.2, torch.randn(24, 96, generator=g) * 0.2]
    path = tmp_path_factory.mktemp("embgemma") / "embgemma.gguf"
    _write_gguf(path, model, dense)
    return model, dense, path


def _reference(model, dense, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        h = model(input_ids=torch.tensor([ids])).last_hidden_state[0].mean(0)
        return F.normalize(h @ dense[0].T @ dense[1].T, dim=-1).numpy()


TEXTS = ["hello world, a longer text that runs well past the sliding window", "hi", "héllo wörld 🤖", "abcdefghij"]


def test_embeddings_match_transformers(gemma):
    from edgeserve.models.encoders.decoder_embed import load_decoder_embedder

    model, dense, path = gemma
    lm = load_decoder_embedder(resolve(str(path)), dtype="float32")
    assert lm.bidirectional and lm.config.hidden_size == 24 and lm.config.pooling == "mean"
    seqs = [lm.encode(t)[0] for t in TEXTS]
    assert seqs[1][0] == 2 and seqs[1][-1] == 1  # <bos> ... <eos>
    got = lm.embed(seqs).numpy()  # one padded batch of different lengths
    want = np.stack([_reference(model, dense, ids) for ids in seqs])
    cos = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert cos.min() > 0.9999
    np.testing.assert_allclose(got, want, atol=5e-5)


def test_served_with_dimensions(gemma):
    model, dense, path = gemma
    with serve(ServerConfig(engine=EngineConfig(kv_cache_gb=0.01), models=(str(path),), keep_alive=None,
                            dtype="float32")) as s, httpx.Client(base_url=s.url, timeout=120) as c:
        full = c.post("/v1/embeddings", json={"model": "embgemma", "input": TEXTS[:2]})
        short = c.post("/v1/embeddings", json={"model": "embgemma", "input": TEXTS[0], "dimensions": 8})
        show = c.post("/api/show", json={"model": "embgemma"}).json()
    assert full.status_code == 200, full.text
    vecs = np.array([d["embedding"] for d in full.json()["data"]])
    assert vecs.shape == (2, 24)
    assert short.status_code == 200 and len(short.json()["data"][0]["embedding"]) == 8
    assert show["capabilities"] == ["embedding"]
