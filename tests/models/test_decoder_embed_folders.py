"""Decoder embedders from Hugging Face sentence-transformers folders: a Qwen3-Embedding-like folder (Qwen3Model
weights without `model.`, tokenizer.json appending <|endoftext|>, last-token pooling, Normalize) and an
EmbeddingGemma-like one (Gemma3TextModel with bidirectional attention, <bos> ... <eos>, mean pooling, two Dense
modules, Normalize) embed as transformers computes them, through /v1/embeddings."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from edgeserve.engine.config import EngineConfig
from edgeserve.server import ServerConfig
from server_helpers import serve
from tiny_gguf import byte_vocab

TEXTS = ["hello world, a longer text that runs well past the sliding window", "hi", "héllo wörld 🤖"]


def _tokenizer(folder, specials: list[str], template: str) -> int:
    """A byte-level BPE tokenizer.json whose post-processor writes `template`; returns the vocabulary size."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(specials + byte_vocab())}
    tok = tokenizers.Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.post_processor = processors.TemplateProcessing(single=template,
                                                       special_tokens=[(s, vocab[s]) for s in specials])
    tok.save(str(folder / "tokenizer.json"))
    return len(vocab)


def _modules(folder, pooling: str, dense: list[torch.Tensor]) -> None:
    from safetensors.torch import save_file

    mods = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({f"pooling_mode_{pooling}": True}))
    for i, w in enumerate(dense, start=2):
        sub = folder / f"{i}_Dense"
        sub.mkdir()
        (sub / "config.json").write_text(json.dumps({"in_features": w.shape[1], "out_features": w.shape[0],
                                                     "bias": False, "activation_function":
                                                     "torch.nn.modules.linear.Identity"}))
        save_file({"linear.weight": w.contiguous()}, str(sub / "model.safetensors"))
        mods.append({"idx": i, "name": str(i), "path": f"{i}_Dense", "type": "sentence_transformers.models.Dense"})
    mods.append({"idx": len(mods), "name": "n", "path": "n_Normalize",
                 "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(mods))


def _qwen3(folder):
    from transformers import Qwen3Config, Qwen3Model

    n = _tokenizer(folder, ["<|endoftext|>"], "$A <|endoftext|>")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    torch.manual_seed(0)
    model = Qwen3Model(Qwen3Config(vocab_size=n, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=256, tie_word_embeddings=True)).eval()
    model.save_pretrained(folder)
    _modules(folder, "lasttoken", [])
    return model, []


def _gemma(folder):
    from transformers import Gemma3TextConfig, Gemma3TextModel

    n = _tokenizer(folder, ["<pad>", "<eos>", "<bos>"], "<bos> $A <eos>")
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))
    torch.manual_seed(1)
    model = Gemma3TextModel(Gemma3TextConfig(
        vocab_size=n, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=8, max_position_embeddings=256,
        use_bidirectional_attention=True, query_pre_attn_scalar=8, pad_token_id=0, eos_token_id=1,
        bos_token_id=2)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(folder)
    g = torch.Generator().manual_seed(2)
    dense = [torch.randn(96, 32, generator=g) * 0.2, torch.randn(24, 96, generator=g) * 0.2]
    _modules(folder, "mean_tokens", dense)
    return model, dense


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    d = tmp_path_factory.mktemp("stfolders")
    (d / "qwen3-emb").mkdir()
    (d / "gemma-emb").mkdir()
    return {"qwen3-emb": (_qwen3(d / "qwen3-emb"), "lasttoken"), "gemma-emb": (_gemma(d / "gemma-emb"), "mean"),
            "paths": [d / "qwen3-emb", d / "gemma-emb"]}


def _reference(model, dense, ids: list[int], pooling: str) -> np.ndarray:
    with torch.no_grad():
        h = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    v = h[-1] if pooling == "lasttoken" else h.mean(0)
    for w in dense:
        v = v @ w.T
    return F.normalize(v, dim=-1).numpy()


@pytest.mark.parametrize("name", ["qwen3-emb", "gemma-emb"])
def test_folder_embeddings_match_transformers(folders, name):
    import tokenizers

    (model, dense), pooling = folders[name]
    path = folders["paths"][0 if name == "qwen3-emb" else 1]
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    seqs = [tok.encode(t).ids for t in TEXTS]
    assert seqs[1][-1] == (0 if name == "qwen3-emb" else 1)  # the end token the post-processor appends
    with serve(ServerConfig(engine=EngineConfig(kv_cache_gb=0.01), models=(str(path),), keep_alive=None,
                            dtype="float32")) as s, httpx.Client(base_url=s.url, timeout=120) as c:
        r = c.post("/v1/embeddings", json={"model": name, "input": TEXTS})
    assert r.status_code == 200, r.text
    got = np.array([d["embedding"] for d in r.json()["data"]])
    want = np.stack([_reference(model, dense, ids, pooling) for ids in seqs])
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=5e-5)
    assert r.json()["usage"]["prompt_tokens"] == sum(len(s) for s in seqs)
