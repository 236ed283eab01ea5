"""WordPiece tokenizers (BERT-family encoders) rebuilt from GGUF metadata (`tokenizer.ggml.model == "bert"`).

llama.cpp's converter stores a WordPiece vocabulary in "phantom space" form: a word-initial piece gets a leading
`▁`, a continuation piece (`##x` in the original vocab.txt) loses its `##`, and `[BRACKETED]` specials stay as they
are. Undoing that gives back the original vocabulary in the same order, so ids are unchanged; the rest is BERT's
usual pipeline: the BERT normalizer (lower-casing and accent stripping when the vocabulary is uncased), the BERT
pre-tokenizer, WordPiece with `[UNK]`, and `[CLS] A [SEP] (B [SEP])` added around the text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from edgeserve.errors import ModelLoadError

PHANTOM_SPACE = "\u2581"


def unphantom(token: str) -> str:
    """A phantom-space GGUF token as its vocab.txt spelling (`▁word` -> `word`, `iece` -> `##iece`)."""
    if token.startswith("[") and token.endswith("]"):
        return token
    if token.startswith(PHANTOM_SPACE):
        return token[1:]
    return "##" + token


def is_uncased(vocab: list[str], types: np.ndarray) -> bool:
    """Whether a vocabulary has no ASCII capitals outside its specials (an uncased BERT lower-cases its input; such
    vocabularies still hold a few non-ASCII capitals such as ℝ)."""
    normal = types == 1
    return not any(normal[i] and any("A" <= ch <= "Z" for ch in tok) for i, tok in enumerate(vocab)
                   if not (tok.startswith("[") and tok.endswith("]")))


def wordpiece_spec(metadata: Mapping[str, Any], tokens: list[str], types: np.ndarray) -> dict[str, Any]:
    """tokenizer.json fields (normalizer, pre-tokenizer, WordPiece model, post-processor, decoder) for a GGUF
    WordPiece vocabulary."""
    vocab = [unphantom(t) for t in tokens]
    index: dict[str, int] = {}
    for i, t in enumerate(vocab):
        index.setdefault(t, i)

    def special(keys: tuple[str, ...], fallback: str) -> tuple[str, int]:
        """The token the first present key names, else the one spelled `fallback`."""
        values = [metadata.get(f"tokenizer.ggml.{k}") for k in keys]
        i = next((int(v) for v in values if v is not None and 0 <= int(v) < len(vocab)), index.get(fallback))
        if i is None:
            raise ModelLoadError(f"GGUF WordPiece tokenizer has no {fallback} token (tokenizer.ggml.{keys[0]})")
        return vocab[i], i

    # older files name [CLS] in cls_token_id; newer ones make it the BOS (and [SEP] the EOS and separator)
    cls = special(("cls_token_id", "bos_token_id"), "[CLS]")
    sep = special(("seperator_token_id", "eos_token_id"), "[SEP]")
    unk, _ = special(("unknown_token_id",), "[UNK]")
    lower = is_uncased(vocab, types)
    return {
        "normalizer": {"type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": True,
                       "strip_accents": None, "lowercase": lower},
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": cls[0], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                       {"SpecialToken": {"id": sep[0], "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": cls[0], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": sep[0], "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}},
                     {"SpecialToken": {"id": sep[0], "type_id": 1}}],
            "special_tokens": {t: {"id": t, "ids": [i], "tokens": [t]} for t, i in {cls, sep}},
        },
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True},
        "model": {"type": "WordPiece", "unk_token": unk, "continuing_subword_prefix": "##",
                  "max_input_chars_per_word": 100, "vocab": index},
    }
