"""Converter parity for encoders (issue 54): a tiny random BERT (transformers' BertModel) saved as a
sentence-transformers folder (the all-MiniLM-L6-v2 layout: WordPiece vocabulary, modules.json and the pooling
config), converted by llama.cpp's own convert_hf_to_gguf.py, loaded by edgeserve's GGUF encoder loader, embeds as
transformers does (the pooling the converter wrote, then L2-normalized) to float32 noise, and tokenizes as the
folder's tokenizer.json does.

nomic-bert and jina-bert-v2 are not here: transformers has no class for them (their checkpoints run as remote code,
which nothing here may fetch); tests/test_gguf_encoders.py checks them against references written from their
published definitions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from converter_parity import convert  # noqa: E402

TEXTS = ["The cat sits on the mat.", "Héllo wörld, naïve café", "UPPER lower MiXeD unbelievably", "a"]
FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "modules.json",
         "sentence_bert_config.json")


@pytest.fixture(scope="module")
def minilm() -> Path:
    from edgeserve.registry import pull

    return pull("all-minilm", progress=False)


def tiny_bert_folder(minilm: Path, dest: Path, pooling: str):
    """A random 2-layer BERT saved with MiniLM's tokenizer and sentence-transformers files, `pooling` ("mean" or
    "cls") in 1_Pooling/config.json; returns the model."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=512, type_vocab_size=2)
    model = BertModel(cfg, add_pooling_layer=False).float().eval()
    with torch.no_grad():  # far from the init, so every part matters
        for name, p in model.named_parameters():
            p.normal_(1.0 if "LayerNorm.weight" in name else 0.0, 0.3 if p.dim() == 1 else 0.15)
    model.save_pretrained(dest)
    for name in FILES:
        shutil.copy(minilm / name, dest / name)
    (dest / "1_Pooling").mkdir()
    (dest / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False}))
    return model


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_converted_bert_embeds_as_transformers(tmp_path, minilm, pooling):
    import tokenizers

    from edgeserve.models.gguf_encoder import load_gguf_encoder
    from edgeserve.registry import resolve

    folder = tmp_path / "bert"
    model = tiny_bert_folder(minilm, folder, pooling)
    gguf = convert(folder, tmp_path / "bert.f32.gguf")
    lm = load_gguf_encoder(resolve(str(gguf)), dtype="float32")
    assert lm.config.pooling == pooling and lm.config.normalize
    hf = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    hf.no_padding()
    hf.no_truncation()
    seqs = [lm.encode(t)[0] for t in TEXTS]
    assert seqs == [hf.encode(t).ids for t in TEXTS]
    got = lm.embed(seqs)
    want = []
    with torch.no_grad():
        for ids in seqs:
            h = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
            want.append(F.normalize(h.mean(0) if pooling == "mean" else h[0], dim=-1))
    assert (got - torch.stack(want)).abs().max().item() < 1e-4
