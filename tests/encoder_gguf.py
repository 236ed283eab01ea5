"""Write BERT-family GGUF files the way llama.cpp's convert_hf_to_gguf.py does, from a Hugging Face state dict and
a WordPiece vocab.txt list: tensor names through gguf's own TensorNameMap, the vocabulary in phantom-space form,
[CLS] as BOS and [SEP] as EOS / separator, `<arch>.pooling_type`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def phantom(tok: str) -> str:
    """llama.cpp's BERT vocabulary spelling (convert_hf_to_gguf.py's `phantom`)."""
    if tok.startswith("[") and tok.endswith("]"):
        return tok
    if tok.startswith("##"):
        return tok[2:]
    return "\u2581" + tok


def write_encoder_gguf(path: Path, arch: str, state: dict[str, torch.Tensor], vocab: list[str], *, hidden: int,
                       layers: int, heads: int, ffn: int, context: int, pooling_type: int, eps: float = 1e-12,
                       rope_base: float | None = None, type_vocab: int = 2, qtype: str = "F32",
                       skip: tuple[str, ...] = (), rename: dict[str, str] | None = None) -> Path:
    """A GGUF of `arch` ('bert' / 'nomic-bert') holding `state` (HF names, mapped as llama.cpp maps them, or by
    `rename` to GGUF names)."""
    import gguf

    arch_id = {"bert": gguf.MODEL_ARCH.BERT, "nomic-bert": gguf.MODEL_ARCH.NOMIC_BERT}[arch]
    names = gguf.get_tensor_name_map(arch_id, layers)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_layer_norm_eps(eps)
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType(pooling_type))
    if rope_base is not None:
        w.add_rope_freq_base(rope_base)
    w.add_token_type_count(type_vocab)
    w.add_tokenizer_model("bert")
    w.add_token_list([phantom(t) for t in vocab])
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in vocab])
    ids = {t: i for i, t in enumerate(vocab)}
    w.add_bos_token_id(ids["[CLS]"])
    w.add_eos_token_id(ids["[SEP]"])
    w.add_sep_token_id(ids["[SEP]"])
    w.add_unk_token_id(ids["[UNK]"])
    w.add_pad_token_id(ids["[PAD]"])
    w.add_add_bos_token(True)
    w.add_add_eos_token(True)
    for hf_name, t in state.items():
        name = (rename or {}).get(hf_name) or names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None or any(s in hf_name for s in skip):
            continue
        data = t.detach().float().numpy()
        if qtype == "F16" and data.ndim == 2:
            data = data.astype(np.float16)
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def minilm_vocab(folder: Path) -> list[str]:
    """all-MiniLM-L6-v2's WordPiece vocabulary (vocab.txt order = ids)."""
    return (folder / "vocab.txt").read_text(encoding="utf-8").splitlines()
