"""Write BERT-family GGUF files the way llama.cpp's convert_hf_to_gguf.py does, from a Hugging Face state dict and
a WordPiece vocab.txt list: tensor names through gguf's own TensorNameMap, the vocabulary in phantom-space form,
[CLS] as BOS and [SEP] as EOS / separator, `<arch>.pooling_type`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from support.gguf_writer import finish

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def phantom(tok: str) -> str:
    """llama.cpp's BERT vocabulary spelling (convert_hf_to_gguf.py's `phantom`)."""
    if tok.startswith("[") and tok.endswith("]"):
        return tok
    if tok.startswith("##"):
        return tok[2:]
    return "\u2581" + tok


def write_encoder_gguf(path: Path, arch: str, state: dict[str, torch.Tensor], vocab: list[str] | bytes, *, hidden: int,
                       layers: int, heads: int, ffn: int, context: int, pooling_type: int, eps: float = 1e-12,
                       rope_base: float | None = None, type_vocab: int = 2, qtype: str = "F32",
                       skip: tuple[str, ...] = (), rename: dict[str, str] | None = None,
                       bpe_merges: list[str] | None = None) -> Path:
    """A GGUF of `arch` ('bert' / 'nomic-bert' / 'jina-bert-v2') holding `state` (HF names, mapped as llama.cpp
    maps them, or by `rename` to GGUF names); `vocab` a WordPiece vocab.txt list, a SentencePiece Unigram model's bytes
    (XLM-RoBERTa), or with `bpe_merges` a RoBERTa byte-level BPE vocabulary (`<s> <pad> </s> <unk>` first)."""
    import gguf

    arch_id = {"bert": gguf.MODEL_ARCH.BERT, "nomic-bert": gguf.MODEL_ARCH.NOMIC_BERT,
               "jina-bert-v2": gguf.MODEL_ARCH.JINA_BERT_V2}[arch]
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
    if isinstance(vocab, bytes):
        add_unigram(w, vocab, len(state[next(k for k in state if "word_embeddings" in k)]))
    elif bpe_merges is not None:
        add_roberta_bpe(w, vocab, bpe_merges)
    else:
        add_wordpiece(w, vocab)
    for hf_name, t in state.items():
        name = (rename or {}).get(hf_name) or names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None or any(s in hf_name for s in skip):
            continue
        data = t.detach().float().numpy()
        if qtype == "F16" and data.ndim == 2:
            data = data.astype(np.float16)
        if qtype == "Q8_0" and data.ndim == 2 and data.shape[-1] % 32 == 0:
            q = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(data, q), raw_dtype=q)
            continue
        w.add_tensor(name, data)
    finish(w)
    return path


def add_wordpiece(w, vocab: list[str]) -> None:
    """A WordPiece vocab.txt as llama.cpp's BertModel.set_vocab writes it."""
    import gguf

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


def add_roberta_bpe(w, tokens: list[str], merges: list[str]) -> None:
    """A RoBERTa byte-level BPE vocabulary as llama.cpp's RobertaModel writes it (tokenizer model gpt2; <s> as BOS,
    </s> as EOS and separator, all three added)."""
    import gguf

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * 4 + [gguf.TokenType.NORMAL] * (len(tokens) - 4))
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_pad_token_id(1)
    w.add_eos_token_id(2)
    w.add_sep_token_id(2)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
    w.add_add_eos_token(True)
    w.add_add_sep_token(True)


def _proto_fields(buf: bytes) -> dict[int, list]:
    """The fields of a protobuf message (varints as ints, length-delimited as bytes): enough to read a
    SentencePiece model's normalizer_spec without the protobuf package."""
    out: dict[int, list] = {}
    i = 0

    def varint() -> int:
        nonlocal i
        shift = value = 0
        while True:
            b = buf[i]
            i += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                return value

    while i < len(buf):
        key = varint()
        field, wire = key >> 3, key & 7
        if wire == 0:
            value = varint()
        elif wire == 2:
            n = varint()
            value, i = buf[i:i + n], i + n
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        elif wire == 1:
            value, i = buf[i:i + 8], i + 8
        else:
            raise ValueError(f"protobuf wire type {wire}")
        out.setdefault(field, []).append(value)
    return out


def add_unigram(w, spm: bytes, vocab_size: int) -> None:
    """A SentencePiece Unigram model (XLM-RoBERTa) as llama.cpp's XLMRobertaModel.set_vocab writes it: pieces in
    fairseq order (`<s> <pad> </s> <unk>`, then pieces 3.. shifted by one), scores, the normalizer's charsmap."""
    import gguf
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_proto=spm)
    norm = _proto_fields(_proto_fields(spm)[3][0])  # ModelProto.normalizer_spec
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    scores = [-10000.0] * vocab_size
    types = [gguf.TokenType.UNUSED] * vocab_size
    for i in range(sp.get_piece_size()):
        tokens[i], scores[i] = sp.id_to_piece(i), sp.get_score(i)
        types[i] = (gguf.TokenType.UNKNOWN if sp.is_unknown(i) else gguf.TokenType.CONTROL if sp.is_control(i)
                    else gguf.TokenType.NORMAL)
    C = gguf.TokenType.CONTROL
    tokens = ["<s>", "<pad>", "</s>", "<unk>"] + tokens[3:-1]
    scores = [0.0] * 4 + scores[3:-1]
    types = [C, C, C, gguf.TokenType.UNKNOWN] + types[3:-1]
    w.add_tokenizer_model("t5")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_add_space_prefix(bool(norm.get(3, [1])[0]))
    w.add_remove_extra_whitespaces(bool(norm.get(4, [1])[0]))
    if norm.get(2):
        w.add_precompiled_charsmap(norm[2][0])
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_sep_token_id(2)
    w.add_unk_token_id(3)
    w.add_pad_token_id(1)
    w.add_add_bos_token(True)
    w.add_add_eos_token(True)
    w.add_add_sep_token(True)


def train_unigram(texts: list[str], vocab_size: int = 400) -> bytes:
    """A small SentencePiece Unigram model (nmt_nfkc normalization, as XLM-R's) trained on `texts`."""
    import io

    import sentencepiece

    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=out, vocab_size=vocab_size,
                                             model_type="unigram", character_coverage=1.0,
                                             normalization_rule_name="nmt_nfkc", hard_vocab_limit=False,
                                             minloglevel=2)
    return out.getvalue()


def xlmr_ids(spm: bytes, text: str, pair: str | None = None) -> list[int]:
    """Hugging Face XLMRobertaTokenizer's ids (SentencePiece ids + 1, unknown -> 3) with <s> / </s> around."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_proto=spm)
    conv = lambda t: [i + 1 if i else 3 for i in sp.encode(t)]  # noqa: E731
    ids = [0, *conv(text), 2]
    return ids + [2, *conv(pair), 2] if pair is not None else ids


def minilm_vocab(folder: Path) -> list[str]:
    """all-MiniLM-L6-v2's WordPiece vocabulary (vocab.txt order = ids)."""
    return (folder / "vocab.txt").read_text(encoding="utf-8").splitlines()
