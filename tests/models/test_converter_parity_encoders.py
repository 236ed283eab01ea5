"""Converter parity for encoders (issue 54): tiny random checkpoints saved as sentence-transformers folders (the
all-MiniLM-L6-v2 layout: WordPiece vocabulary, modules.json and the pooling config), converted by llama.cpp's own
convert_hf_to_gguf.py to f32, loaded by edgeserve's GGUF encoder loader, embed as the reference does (the pooling the
converter wrote, then L2-normalized, as served) to float32 noise, and tokenize as the folder's tokenizer.json does:
- BERT (transformers' BertModel; mean and CLS pooling);
- nomic-bert (nomic-embed-text v1 / v1.5): the folder holds the real checkpoint's config.json and tensor names, and
  transformers 5's own NomicBertModel (which renames those tensors on load) is the reference. llama.cpp's converter
  reads the config through transformers' AutoConfig, whose NomicBertConfig takes its sizes from its own keys
  (hidden_size, num_hidden_layers, ...) and defaults them, ignoring nomic's n_embd / n_layer: the real
  nomic-embed-text-v1.5's sizes are those defaults, so its conversion is right, but a tiny config must give the
  sizes under both names or the converter writes a 768-wide, 12-layer header over 32-wide tensors;
- jina-bert-v2 (jina-embeddings-v2: JinaBertForMaskedLM, fused GEGLU `gated_layers`, with and without the query /
  key LayerNorms): transformers has no class for it (the checkpoints run as remote code, which nothing here may
  fetch), so the folder holds the real checkpoint's config.json and tensor names and the reference is
  tests/encoder_references.py's float64 code written from the published definition.
edgeserve loads the nomic-bert folder too (models/encoders/nomic_folder.py; also under transformers' own tensor names); a
jina-bert-v2 folder is refused with a one-line reason (the converted GGUF is the way in).
XLM-RoBERTa (bge-m3, bge-reranker-v2-m3) is in test_converter_parity_xlmr.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from converter_parity import convert  # noqa: E402
from encoder_references import jina_reference, jina_state, nomic_reference, nomic_state  # noqa: E402

TEXTS = ["The cat sits on the mat.", "Héllo wörld, naïve café", "UPPER lower MiXeD unbelievably", "a"]
FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "modules.json",
         "sentence_bert_config.json")


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
    st_files(minilm, dest, pooling, 64)
    return model


def st_files(minilm: Path, dest: Path, pooling: str, width: int) -> None:
    """MiniLM's tokenizer and sentence-transformers files in `dest`, `pooling` ("mean" or "cls") in
    1_Pooling/config.json."""
    for name in FILES:
        shutil.copy(minilm / name, dest / name)
    (dest / "1_Pooling").mkdir()
    (dest / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": width, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False}))


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_converted_bert_embeds_as_transformers(tmp_path, minilm, pooling):
    import tokenizers

    from edgeserve.models.encoders.gguf_encoder import load_gguf_encoder
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


def remote_code_folder(minilm: Path, dest: Path, config: dict, state: dict[str, torch.Tensor]) -> Path:
    """A checkpoint folder of a remote-code encoder: its config.json and safetensors under the real names, MiniLM's
    tokenizer, mean pooling."""
    from safetensors.torch import save_file

    dest.mkdir()
    (dest / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, dest / "model.safetensors", metadata={"format": "pt"})
    st_files(minilm, dest, "mean", config.get("n_embd", config.get("hidden_size")))
    return dest


def nomic_config(hidden: int, layers: int, heads: int, ffn: int, vocab: int, base: float) -> dict:
    """nomic-embed-text-v1.5's config.json fields (the ones llama.cpp's converter checks) at a tiny size, with the
    sizes also under transformers' own NomicBertConfig names (see the module docstring)."""
    return {"architectures": ["NomicBertModel"], "model_type": "nomic_bert", "activation_function": "swiglu",
            "causal": False, "n_embd": hidden, "n_head": heads, "n_inner": ffn, "n_layer": layers,
            "n_positions": 8192, "max_trained_positions": 2048, "layer_norm_epsilon": 1e-12, "prenorm": False,
            "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False, "rotary_emb_base": base,
            "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False, "rotary_emb_scale_base": None,
            "type_vocab_size": 2, "vocab_size": vocab,
            "hidden_size": hidden, "num_attention_heads": heads, "intermediate_size": ffn, "num_hidden_layers": layers,
            "layer_norm_eps": 1e-12, "rope_parameters": {"rope_type": "default", "rope_theta": base}}


def jina_config(hidden: int, layers: int, heads: int, ffn: int, vocab: int) -> dict:
    """jina-embeddings-v2-base-en's config.json fields, at a tiny size."""
    return {"architectures": ["JinaBertForMaskedLM"], "model_type": "bert", "position_embedding_type": "alibi",
            "feed_forward_type": "geglu", "hidden_act": "gelu", "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "intermediate_size": ffn, "max_position_embeddings": 8192,
            "layer_norm_eps": 1e-12, "type_vocab_size": 2, "vocab_size": vocab, "pad_token_id": 0}


def _embed_gguf(gguf: Path, folder: Path):
    """edgeserve's served embeddings of TEXTS from the GGUF (float32), after checking its ids against the folder's
    tokenizer.json; returns (ids, embeddings)."""
    import tokenizers

    from edgeserve.models.encoders.gguf_encoder import load_gguf_encoder
    from edgeserve.registry import resolve

    lm = load_gguf_encoder(resolve(str(gguf)), dtype="float32")
    assert lm.config.pooling == "mean" and lm.config.normalize
    hf = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    hf.no_padding()
    hf.no_truncation()
    seqs = [lm.encode(t)[0] for t in TEXTS]
    assert seqs == [hf.encode(t).ids for t in TEXTS]
    return seqs, lm.embed(seqs)


def _load_folder(folder: Path):
    """The Hugging Face folder as the server loads an embedding model (float32)."""
    from edgeserve.models.encoders.embedders import load_embedding_model
    from edgeserve.registry import resolve

    return load_embedding_model(resolve(str(folder)), dtype="float32")


def _folder_refused(folder: Path) -> None:
    """Loading the Hugging Face folder itself is a one-line refusal naming why."""
    from edgeserve.errors import UnsupportedModelError
    from edgeserve.models.encoders.bert import encoder_config

    with pytest.raises(UnsupportedModelError) as e:
        encoder_config(folder)
    assert "\n" not in str(e.value)


def test_converted_nomic_bert_embeds_as_transformers(tmp_path, minilm):
    """The checkpoint under nomic's own tensor names (`encoder.layers.N.attn.Wqkv`, `mlp.fc11` / `fc12`, `emb_ln`),
    which transformers' NomicBertModel renames on load; the float64 reference from the definition agrees too."""
    from transformers import NomicBertModel

    hidden, layers, heads, ffn, base = 32, 2, 4, 48, 1000.0
    sd = nomic_state(hidden, layers, ffn, 30522)
    folder = remote_code_folder(minilm, tmp_path / "nomic", nomic_config(hidden, layers, heads, ffn, 30522, base), sd)
    gguf = convert(folder, tmp_path / "nomic.f32.gguf")
    seqs, got = _embed_gguf(gguf, folder)
    model = NomicBertModel.from_pretrained(str(folder)).float().eval()
    with torch.no_grad():
        want = torch.stack([F.normalize(model(input_ids=torch.tensor([ids])).last_hidden_state[0].mean(0), dim=-1)
                            for ids in seqs])
    assert (got - want).abs().max().item() < 1e-5
    exact = torch.stack([nomic_reference(sd, ids, heads, layers, base, 1e-12) for ids in seqs]).float()
    assert (want - exact).abs().max().item() < 1e-5
    lm = _load_folder(folder)
    assert (lm.config.pooling, lm.config.normalize, lm.config.rope_theta) == ("mean", True, base)
    assert [lm.encode(t)[0] for t in TEXTS] == seqs
    assert (lm.embed(seqs) - want).abs().max().item() < 1e-5


def test_nomic_folder_under_transformers_names(tmp_path, minilm):
    """A folder with transformers 5's own NomicBertModel names (separate q / k / v projections, up / gate / down)
    loads as the published layout does; an unsupported variant (experts) is refused naming the field."""
    from safetensors.torch import load_file, save_file

    from edgeserve.errors import UnsupportedModelError

    sd = nomic_state(32, 2, 48, 30522)
    cfg = nomic_config(32, 2, 4, 48, 30522, 1000.0)
    folder = remote_code_folder(minilm, tmp_path / "nomic", cfg, sd)
    names = {"encoder.layers.": "layers.", "emb_ln": "embeddings.LayerNorm", "attn.out_proj": "self_attn.o_proj",
             "fc11": "up_proj", "fc12": "gate_proj", "fc2": "down_proj", "norm1": "post_attention_layernorm",
             "norm2": "post_mlp_layernorm"}
    native = {}
    for k, v in load_file(folder / "model.safetensors").items():
        for a, b in names.items():
            k = k.replace(a, b)
        if k.endswith("attn.Wqkv.weight"):
            for part, w in zip("qkv", v.chunk(3)):
                native[k.replace("attn.Wqkv", f"self_attn.{part}_proj")] = w.contiguous()
        else:
            native[k] = v
    other = remote_code_folder(minilm, tmp_path / "native", cfg, {})
    save_file(native, other / "model.safetensors", metadata={"format": "pt"})
    ids = [_load_folder(folder).encode(t)[0] for t in TEXTS]
    assert torch.equal(_load_folder(other).embed(ids), _load_folder(folder).embed(ids))
    (other / "config.json").write_text(json.dumps(dict(cfg, moe_every_n_layers=2)))
    with pytest.raises(UnsupportedModelError, match="moe_every_n_layers"):
        _load_folder(other)


@pytest.mark.parametrize("heads, qk_norm", [(4, False), (6, True)])
def test_converted_jina_bert_v2_embeds_as_reference(tmp_path, minilm, heads, qk_norm):
    """The real checkpoint's fused GEGLU (`mlp.gated_layers`, gate rows first), a power-of-two head count and one
    that is not (ALiBi's interleaved slopes), the optional query / key LayerNorms."""
    hidden, layers, ffn = 8 * heads, 2, 40
    sd = jina_state(hidden, layers, ffn, 30522, fused=True, qk_norm=qk_norm)
    real = {k.replace("mlp.up_gated_layer.", "mlp.gated_layers."): v for k, v in sd.items()}
    folder = remote_code_folder(minilm, tmp_path / "jina", jina_config(hidden, layers, heads, ffn, 30522), real)
    gguf = convert(folder, tmp_path / "jina.f32.gguf")
    seqs, got = _embed_gguf(gguf, folder)
    want = torch.stack([jina_reference(sd, ids, heads, layers, ffn, 1e-12) for ids in seqs]).float()
    assert (got - want).abs().max().item() < 1e-5
    _folder_refused(folder)
