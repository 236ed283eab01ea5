"""Tokenizers from GGUF metadata or a Hugging Face folder, behind one `Tokenizer` type.

GGUF files carry no `tokenizer.json`; they store the vocabulary under llama.cpp's key names. We rebuild
an equivalent `tokenizers.Tokenizer` from those keys:

- `tokenizer.ggml.model == "gpt2"`: byte-level BPE with the file's merges. How text is split before
  BPE depends on `tokenizer.ggml.pre` (pretokenizers.py: the original `tokenizer.json` splits for each
  name llama.cpp knows); a few names mean SentencePiece-style BPE over raw UTF-8 instead, as `gemma4`.
- `tokenizer.ggml.model == "llama"`: SentencePiece BPE. The file has scores instead of merges; merging
  the best-scoring pair first is what SentencePiece does, so merges are derived from the scores.
  `▁` stands for a space, unknown characters fall back to `<0xXX>` byte tokens.
- `tokenizer.ggml.model == "bert"`: WordPiece (BERT-family encoders); see wordpiece.py.
- `tokenizer.ggml.model == "t5"`: SentencePiece Unigram (XLM-RoBERTa encoders); see unigram.py.

Tokens typed control/unknown in `tokenizer.ggml.token_type` become special added tokens and
user-defined ones plain added tokens, so both are matched whole in the input text, as Hugging Face
and llama.cpp do.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from tokenizers.decoders import DecodeStream

from edgeserve.errors import ModelLoadError, UnsupportedModelError

from .pretokenizers import PreTokenizer, pre_tokenizer_for, pre_tokenizer_steps

log = logging.getLogger(__name__)

# llama.cpp's token types (gguf.TokenType).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Tokens that end an assistant turn in common chat formats; any present in the vocabulary stops generation
# (llama.cpp's list).
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<end_of_turn>",
    "<turn|>",  # Gemma 4
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<EOT>",
    "_<EOT>",
    "<end_of_utterance>",
)

class Tokenizer:
    """Text <-> token ids for one model, plus the ids that matter to generation (BOS, EOS, end of turn)."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_id: int | None = None,
        eos_id: int | None = None,
        eot_ids: Iterable[int] = (),
        add_bos: bool = False,
        vocab_size: int | None = None,
    ):
        self.backend = backend
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eot_ids: frozenset[int] = frozenset(eot_ids) | ({eos_id} if eos_id is not None else set())
        self.add_bos = add_bos and bos_id is not None
        self.vocab_size: int = max(vocab_size or 0, backend.get_vocab_size(with_added_tokens=True))
        # Byte-fallback tokens (`<0xXX>`): decode() turns a whole run of them into U+FFFDs when the run is not
        # valid UTF-8, so a run's text can change until a token of another kind ends it.
        self.byte_fallback_ids: frozenset[int] = frozenset()
        if getattr(backend.model, "byte_fallback", False):
            byte_ids = (backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
            self.byte_fallback_ids = frozenset(i for i in byte_ids if i is not None)

    @property
    def bos_token(self) -> str:
        """The BOS token's text, or '' when the model has none."""
        return "" if self.bos_id is None else self.id_to_token(self.bos_id) or ""

    @property
    def eos_token(self) -> str:
        """The EOS token's text, or '' when the model has none."""
        return "" if self.eos_id is None else self.id_to_token(self.eos_id) or ""

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry for one id, as stored (byte-level spelling for GPT-2 style vocabularies)."""
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry, or None."""
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; special tokens written in the text become their single ids.

        `add_special_tokens` prepends BOS when the model wants one (`add_bos`); nothing is appended.
        """
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_special_tokens and self.add_bos else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text for a sequence of ids."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = False) -> Callable[[int], str]:
        """A function fed one id at a time that returns the new text it completes ('' while a
        multi-byte character is still incomplete); the pieces join to `decode` of all ids."""
        stream = DecodeStream(skip_special_tokens=skip_special_tokens)

        def step(token_id: int) -> str:
            return stream.step(self.backend, token_id) or ""

        return step

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_token!r}, "
            f"eot_ids={sorted(self.eot_ids)}, add_bos={self.add_bos})"
        )


# ---------------------------------------------------------------------------------------------- GGUF


def _add_bos_default(model: str, pre) -> bool:
    """Whether a GGUF vocabulary of tokenizer `model` adds BOS when the file does not say."""
    if pre is not None:
        return pre.add_bos
    if model in ("llama", "gemma4"):
        return True  # llama.cpp adds BOS to a SentencePiece vocabulary unless told otherwise
    if model in ("bert", "t5"):
        return False  # [CLS] ... [SEP] / <s> ... </s> come from the post-processor (wordpiece / unigram)
    raise UnsupportedModelError(
        f"GGUF tokenizer model {model!r} is not supported (supported: 'gpt2' byte-level BPE, 'llama' SentencePiece, "
        "'gemma4' SentencePiece-style BPE with merges, 'bert' WordPiece, 't5' Unigram)"
    )


def _gguf_token_id(metadata: Mapping[str, Any], key: str, vocab_size: int) -> int | None:
    """The `tokenizer.ggml.{key}` token id when the file names one inside the vocabulary."""
    value = metadata.get(f"tokenizer.ggml.{key}")
    return int(value) if value is not None and 0 <= int(value) < vocab_size else None


def _added_tokens(metadata: Mapping[str, Any], tokens: list[str], types: np.ndarray) -> list[dict]:
    """The special (control, unknown and named) and user-defined tokens, as tokenizers' `added_tokens`."""
    named_ids = [_gguf_token_id(metadata, k, len(tokens))
                 for k in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")]
    special_mask = np.isin(types, (TOKEN_CONTROL, TOKEN_UNKNOWN))
    special_mask[[i for i in named_ids if i is not None]] = True
    user_mask = (types == TOKEN_USER_DEFINED) & ~special_mask
    return [
        {"id": int(i), "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": bool(special_mask[i])}
        for i in np.flatnonzero(special_mask | user_mask)
    ]  # fmt: skip


def _gguf_backend(metadata: Mapping[str, Any], model: str, tokens: list[str], types: np.ndarray, pre,
                  added: list[dict]) -> tokenizers.Tokenizer:
    """The tokenizers backend of a GGUF vocabulary (BPE / SentencePiece ones cached, with their merges derived)."""

    def build() -> tokenizers.Tokenizer:
        if model == "bert":
            from .wordpiece import wordpiece_spec

            spec = wordpiece_spec(metadata, tokens, types)
        elif model == "t5":
            from .unigram import unigram_spec

            spec = unigram_spec(metadata, tokens, types)
        else:
            byte_level = pre is not None and pre.byte_level
            spec = _gpt2_spec(metadata, tokens, pre) if byte_level else _spm_spec(metadata, tokens, types, model)
        try:
            return tokenizers.Tokenizer.from_str(json.dumps({"version": "1.0", "added_tokens": added, **spec}))
        except Exception as e:  # the Rust side reports bad vocabularies/merges as a plain Exception
            raise ModelLoadError(f"GGUF tokenizer metadata is invalid: {e}") from None

    # WordPiece / Unigram specs need no merges derived: built on each load, never cached (so never stale)
    return build() if model in ("bert", "t5") else cached_tokenizer(_gguf_tokenizer_key(metadata, added), build)


def tokenizer_from_gguf(metadata: Mapping[str, Any]) -> Tokenizer:
    """The tokenizer a GGUF file describes (`tokenizer.ggml.*` keys, as `GGUFFile.metadata` gives them)."""
    model = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if model is None or not tokens:
        raise ModelLoadError("GGUF metadata has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens)")
    tokens = list(tokens)
    types = np.asarray(metadata.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens), dtype=np.int64)
    if len(types) != len(tokens):
        raise ModelLoadError(f"GGUF tokenizer has {len(tokens)} tokens but {len(types)} token types")
    pre = pre_tokenizer_for(metadata.get("tokenizer.ggml.pre")) if model == "gpt2" else None
    add_bos_default = _add_bos_default(model, pre)
    backend = _gguf_backend(metadata, model, tokens, types, pre, _added_tokens(metadata, tokens, types))
    eot_ids = {i for i in (_gguf_token_id(metadata, "eot_token_id", len(tokens)),
                           _gguf_token_id(metadata, "eom_token_id", len(tokens))) if i is not None}
    eot_ids = _without_harmony_message_end(backend, eot_ids | _named_end_of_turn_ids(backend))
    add_bos = metadata.get("tokenizer.ggml.add_bos_token")
    return Tokenizer(
        backend,
        bos_id=_gguf_token_id(metadata, "bos_token_id", len(tokens)),
        eos_id=_gguf_token_id(metadata, "eos_token_id", len(tokens)),
        eot_ids=eot_ids,
        add_bos=bool(add_bos_default if add_bos is None else add_bos),
        vocab_size=len(tokens),
    )


# Bump when the tokenizer.json this module builds from GGUF metadata changes, so stale cached ones are not used.
_TOKENIZER_CACHE_VERSION = 2


def _gguf_tokenizer_key(metadata: Mapping[str, Any], added: list[dict[str, Any]]) -> str:
    """A digest of everything the tokenizer built from this metadata depends on."""
    import hashlib

    h = hashlib.sha256(f"v{_TOKENIZER_CACHE_VERSION} tokenizers {tokenizers.__version__}".encode())
    for key in sorted(k for k in metadata if k.startswith("tokenizer.ggml.")):
        value = metadata[key]
        h.update(key.encode())
        if isinstance(value, np.ndarray):
            h.update(str(value.dtype).encode() + value.tobytes())
        elif isinstance(value, (list, tuple)):
            h.update(json.dumps(list(value), default=float).encode())
        else:
            h.update(repr(value).encode())
    h.update(json.dumps(added).encode())
    return h.hexdigest()[:32]


def cached_tokenizer(key: str, build: Callable[[], tokenizers.Tokenizer]) -> tokenizers.Tokenizer:
    """The tokenizer cached under `key` in <edgeserve home>/tokenizers, else `build()` (then cached): building a
    SentencePiece vocabulary's merges from a GGUF takes seconds for a 262k-token one (Gemma). An unreadable cache
    entry is rebuilt; a cache that cannot be written only costs the next load the build again."""
    from edgeserve.registry.paths import edgeserve_home, write_text_atomic

    path = edgeserve_home() / "tokenizers" / f"{key}.json"
    if path.is_file():
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
            os.utime(path)  # recently used: kept when the cache is trimmed
            return backend
        except Exception as e:  # a truncated or foreign file: build again and replace it
            log.warning("ignoring the cached tokenizer %s (%s)", path, e)
    backend = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, backend.to_str())
        _trim_cache(path.parent, TOKENIZER_CACHE_ENTRIES)
    except OSError as e:
        log.warning("could not cache the tokenizer in %s (%s)", path.parent, e)
    return backend


# Cached tokenizers kept (the least recently used go first): a few MB to 15 MB each.
TOKENIZER_CACHE_ENTRIES = 16


def _trim_cache(folder: Path, keep: int) -> None:
    """Delete all but the `keep` most recently used cache entries of `folder`."""
    entries = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[keep:]:
        old.unlink(missing_ok=True)


def _gpt2_spec(metadata: Mapping[str, Any], tokens: list[str], pre: PreTokenizer) -> dict[str, Any]:
    """tokenizer.json fields for a byte-level BPE vocabulary."""
    merges = metadata.get("tokenizer.ggml.merges")
    if not merges:
        raise ModelLoadError("GGUF tokenizer 'gpt2' has no tokenizer.ggml.merges")
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "normalizer": {"type": "NFC"} if pre.nfc else None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": pre_tokenizer_steps(pre)},
        "post_processor": None,
        "decoder": byte_level,
        # Normal tokens are stored in the byte-level alphabet, added ones as raw text; both go in as they are,
        # so ids never shift, and the ByteLevel decoder passes raw text through untouched.
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
            "ignore_merges": pre.ignore_merges, "vocab": dict(zip(tokens, range(len(tokens)))), "merges": list(merges),
        },  # fmt: skip
    }


def _spm_spec(metadata: Mapping[str, Any], tokens: list[str], types: np.ndarray, model: str) -> dict[str, Any]:
    """tokenizer.json fields for a SentencePiece BPE vocabulary (`▁` spaces, byte fallback), merging by the file's
    merges where it has them (Gemma 4's 'gemma4' model and 'gpt2' ones with a SentencePiece-style pre-tokenizer
    name: raw UTF-8 pieces, ranked merges), else by its scores."""
    file_merges = metadata.get("tokenizer.ggml.merges")
    scores = metadata.get("tokenizer.ggml.scores")
    if not file_merges and (scores is None or len(scores) != len(tokens)):
        raise ModelLoadError("GGUF tokenizer 'llama' needs one tokenizer.ggml.scores entry per token")
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    # llama.cpp's default: a dummy prefix for SentencePiece ('llama'), none for the BPE-typed models
    prefix_space = bool(metadata.get("tokenizer.ggml.add_space_prefix", model == "llama"))
    decoders: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if prefix_space:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    # SentencePiece's dummy prefix goes before every stretch of text, even one that already starts with a
    # space and one that follows a special token, as in llama.cpp and Llama 2's own tokenizer.json.
    # (A Metaspace pre-tokenizer would skip both cases.)
    normalizers: list[dict[str, Any]] = [{"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]
    if prefix_space:
        normalizers.insert(0, {"type": "Prepend", "prepend": "▁"})
    return {
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE", "dropout": None, "continuing_subword_prefix": None, "end_of_word_suffix": None,
            "unk_token": tokens[int(unk)] if unk is not None and 0 <= int(unk) < len(tokens) else None,
            "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
            "vocab": dict(zip(tokens, range(len(tokens)))),
            "merges": [_split_merge(m) for m in file_merges] if file_merges else
            spm_merges(tokens, scores, types == TOKEN_NORMAL),
        },  # fmt: skip
    }


def _split_merge(merge: str) -> tuple[str, str]:
    """A GGUF merge "left right" as its pair (split at the first space after the first character, as llama.cpp
    does, so a left part that is itself a space survives)."""
    cut = merge.find(" ", 1)
    if cut < 0:
        raise ModelLoadError(f"GGUF tokenizer merge {merge!r} has no space")
    return merge[:cut], merge[cut + 1:]


def spm_merges(tokens: Sequence[str], scores: Sequence[float], mergeable: np.ndarray) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's "merge the best-scoring pair" rule.

    Every way of splitting a mergeable token into two mergeable tokens is a merge, ranked by the
    token's score (best first), then by longer left part, longer right part, and vocabulary order.
    """
    ids = {t: i for i, t in enumerate(tokens) if mergeable[i]}
    candidates = []
    for token, i in ids.items():
        splits = [(token[:k], token[k:]) for k in range(1, len(token))]
        found = sorted((ids[a], ids[b], a, b) for a, b in splits if a in ids and b in ids)
        first = len(candidates)  # position in vocabulary order: the last tie-breaker
        candidates.extend((-scores[i], -len(a), -len(b), n, a, b) for n, (_, _, a, b) in enumerate(found, first))
    candidates.sort()
    return [(a, b) for *_, a, b in candidates]


def _named_end_of_turn_ids(backend: tokenizers.Tokenizer) -> set[int]:
    ids = map(backend.token_to_id, END_OF_TURN_TOKENS)
    return {i for i in ids if i is not None}


def _without_harmony_message_end(backend: tokenizers.Tokenizer, eot_ids: set[int]) -> set[int]:
    """gpt-oss (harmony, a vocabulary with <|return|> and <|call|>): <|end|> closes a message inside the turn
    (the reasoning before the answer), never the turn, whatever the metadata names (openai/harmony's stop tokens
    for an assistant reply are <|return|> and <|call|> only)."""
    if backend.token_to_id("<|return|>") is None or backend.token_to_id("<|call|>") is None:
        return eot_ids
    return eot_ids - {backend.token_to_id("<|end|>")}


# ------------------------------------------------------------------------------------ Hugging Face


def load_json_if_exists(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, {} if the file is absent; a clear error if it is not valid JSON."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return value


def special_token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def hf_special_tokens(folder: Path) -> tuple[str | None, str | None]:
    """`(bos_token, eos_token)` texts from tokenizer_config.json, falling back to special_tokens_map.json."""
    config = load_json_if_exists(folder / "tokenizer_config.json")
    special_map = load_json_if_exists(folder / "special_tokens_map.json")

    def text(key: str) -> str | None:
        return special_token_text(config.get(key)) or special_token_text(special_map.get(key))

    return text("bos_token"), text("eos_token")


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def tokenizer_from_hf_folder(path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer of a Hugging Face model folder (tokenizer.json, with tokenizer_config.json,
    special_tokens_map.json, generation_config.json and config.json consulted when present)."""
    folder = Path(path)
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelLoadError(f"{folder} has no tokenizer.json (slow-only tokenizers are not supported)")
    try:
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as e:  # the Rust side reports parse errors as a plain Exception
        raise ModelLoadError(f"cannot load {tokenizer_file}: {e}") from None

    config = load_json_if_exists(folder / "tokenizer_config.json")
    generation = load_json_if_exists(folder / "generation_config.json")
    model_config = load_json_if_exists(folder / "config.json")
    bos_text, eos_text = hf_special_tokens(folder)

    def resolve(text: str | None, key: str) -> int | None:
        if text is not None and (i := backend.token_to_id(text)) is not None:
            return i
        ids = _as_id_list(generation.get(key)) or _as_id_list(model_config.get(key))
        return ids[0] if ids else None

    bos_id, eos_id = resolve(bos_text, "bos_token_id"), resolve(eos_text, "eos_token_id")
    eot_ids = set(_as_id_list(generation.get("eos_token_id")) or _as_id_list(model_config.get("eos_token_id")))
    eot_ids = _without_harmony_message_end(backend, eot_ids | _named_end_of_turn_ids(backend))

    add_bos = config.get("add_bos_token")
    if add_bos is None and bos_id is not None:
        # No explicit flag: the tokenizer.json post-processor decides, as in transformers.
        probe = backend.encode("a", add_special_tokens=True).ids
        add_bos = bool(probe) and probe[0] == bos_id
    return Tokenizer(backend, bos_id=bos_id, eos_id=eos_id, eot_ids=eot_ids, add_bos=bool(add_bos))
