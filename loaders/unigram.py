"""SentencePiece Unigram tokenizers (XLM-RoBERTa: bge-m3, multilingual-e5, bge-reranker-v2-m3) rebuilt from GGUF
metadata (`tokenizer.ggml.model == "t5"`).

llama.cpp's converter stores the pieces in the model's id order (XLM-R's fairseq order: `<s> <pad> </s> <unk>`, then
the SentencePiece pieces shifted by one) with their log-probability scores, the SentencePiece normalizer's
`precompiled_charsmap`, `add_space_prefix` and `remove_extra_whitespaces`. That is Hugging Face's XLM-R
tokenizer.json: the precompiled normalizer, runs of spaces collapsed, `▁` for spaces with one prepended, the Unigram
model, and `<s> A </s>` (pairs `<s> A </s> </s> B </s>`) from `add_bos_token` / `add_eos_token` / `add_sep_token`.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import numpy as np

from edgeserve.errors import ModelLoadError


def _charsmap(metadata: Mapping[str, Any]) -> str | None:
    """The precompiled charsmap as base64 (tokenizers' Precompiled normalizer), or None when the file has none."""
    raw = metadata.get("tokenizer.ggml.precompiled_charsmap")
    if raw is None or len(raw) == 0:
        return None
    data = bytes(np.asarray(raw, dtype=np.int64).astype(np.uint8)) if not isinstance(raw, (bytes, str)) else raw
    return base64.b64encode(data.encode("latin-1") if isinstance(data, str) else data).decode()


def special_template(metadata: Mapping[str, Any], tokens: list[str]) -> dict[str, Any] | None:
    """A TemplateProcessing post-processor: `[bos] A [eos]` and `[bos] A [eos] [sep] B [eos]` per the file's add_*
    flags (llama.cpp's rerank layout), or None when it adds neither BOS nor EOS."""
    def tok(key: str) -> str | None:
        i = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos = tok("bos_token_id") if metadata.get("tokenizer.ggml.add_bos_token") else None
    eos = tok("eos_token_id") if metadata.get("tokenizer.ggml.add_eos_token") else None
    sep = tok("seperator_token_id") if metadata.get("tokenizer.ggml.add_sep_token") else None
    if bos is None and eos is None:
        return None
    special = lambda t, type_id=0: {"SpecialToken": {"id": t, "type_id": type_id}}  # noqa: E731
    single = [*([special(bos)] if bos else []), {"Sequence": {"id": "A", "type_id": 0}},
              *([special(eos)] if eos else [])]
    pair = [*single, *([special(sep, 1)] if sep else []), {"Sequence": {"id": "B", "type_id": 1}},
            *([special(eos, 1)] if eos else [])]
    ids = {t: tokens.index(t) for t in (bos, eos, sep) if t is not None}
    return {"type": "TemplateProcessing", "single": single, "pair": pair,
            "special_tokens": {t: {"id": t, "ids": [i], "tokens": [t]} for t, i in ids.items()}}


def unigram_spec(metadata: Mapping[str, Any], tokens: list[str], types: np.ndarray) -> dict[str, Any]:
    """tokenizer.json fields (normalizer, Metaspace pre-tokenizer, Unigram model, post-processor, decoder) for a
    GGUF SentencePiece Unigram vocabulary."""
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ModelLoadError("GGUF tokenizer 't5' (Unigram) needs one tokenizer.ggml.scores entry per token")
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    if unk is None:
        found = np.flatnonzero(types == 2)
        unk = int(found[0]) if len(found) else None
    normalizers: list[dict[str, Any]] = []
    charsmap = _charsmap(metadata)
    if charsmap is not None:
        normalizers.append({"type": "Precompiled", "precompiled_charsmap": charsmap})
    if metadata.get("tokenizer.ggml.remove_extra_whitespaces", True):
        normalizers.append({"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "})
    prepend = "always" if metadata.get("tokenizer.ggml.add_space_prefix", True) else "never"
    metaspace = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": prepend, "split": True}
    return {
        "normalizer": {"type": "Sequence", "normalizers": normalizers} if normalizers else None,
        "pre_tokenizer": metaspace,
        "post_processor": special_template(metadata, tokens),
        "decoder": metaspace,
        "model": {"type": "Unigram", "unk_id": None if unk is None else int(unk), "byte_fallback": False,
                  "vocab": [[t, float(s)] for t, s in zip(tokens, scores)]},
    }
