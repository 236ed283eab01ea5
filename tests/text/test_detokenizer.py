"""IncrementalDetokenizer fuzzed with real tokenizers: streamed text is never retracted and joins to decode()."""

from __future__ import annotations

import numpy as np
import pytest
from test_tokenizer import spm  # noqa: F401  (the tiny SentencePiece byte-fallback model, as a fixture)
from tiny_gguf import byte_vocab

from edgeserve.loaders.gguf_file import GGUFFile
from edgeserve.loaders.tokenizer import Tokenizer, tokenizer_from_gguf
from edgeserve.text.detokenizer import IncrementalDetokenizer

TEXTS = [
    "日本語のテキストと中文文本。한국어도.",
    "emoji 😀🎉 family 👩‍👩‍👧 flag 🇫🇷 ok",
    "café naïve Zürich ∑∫√≠ ",
    "Plain ASCII words, numbers 12345 and\nnew lines.",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𐍈 ﷽",
]


def check_stream(tok: Tokenizer, ids: list[int], rng: np.random.Generator, prompt: list[int] | None = None) -> None:
    """Push `ids` in random chunks; every step's text must be a prefix of the final decode."""
    full = tok.decode([*(prompt or []), *ids])
    final = full[len(tok.decode(prompt)):] if prompt else full
    detok = IncrementalDetokenizer(tok.decode, prompt, tok.byte_fallback_ids)
    shown = ""
    i = 0
    while i < len(ids):
        n = int(rng.integers(1, 5))
        shown += detok.push(ids[i:i + n])
        i += n
        assert final.startswith(shown), (prompt, ids, shown, final)  # never text that changes later
    if not final.endswith("\ufffd") and ids[-1] not in tok.byte_fallback_ids:
        assert shown == final, (prompt, ids)  # nothing is held back once characters are complete
    shown += detok.flush()
    assert shown == final, (prompt, ids)


def random_sequence(rng: np.random.Generator, tok: Tokenizer, byte_ids: dict[int, int]) -> list[int]:
    """Random ids, encoded multi-byte text (sliced anywhere) and single byte tokens, mixed."""
    ids: list[int] = []
    for _ in range(int(rng.integers(1, 5))):
        kind = rng.integers(0, 3)
        if kind == 0:
            ids += rng.integers(0, tok.vocab_size, size=int(rng.integers(1, 8))).tolist()
        elif kind == 1:
            enc = tok.encode(TEXTS[int(rng.integers(len(TEXTS)))], add_special_tokens=False)
            a = int(rng.integers(0, len(enc)))
            ids += enc[a:a + int(rng.integers(1, 16))]
        else:
            char = TEXTS[int(rng.integers(len(TEXTS)))][int(rng.integers(0, 10))]
            ids += [byte_ids[b] for b in char.encode()]  # a character spelled as separate byte tokens
    return ids


def fuzz(tok: Tokenizer, byte_ids: dict[int, int], seed: int, cases: int) -> None:
    rng = np.random.default_rng(seed)
    for n in range(cases):
        ids = random_sequence(rng, tok, byte_ids)
        prompt = tok.encode(TEXTS[n % len(TEXTS)], add_special_tokens=False)[: int(rng.integers(1, 12))]
        # a prompt's own text is taken as final, so it must not end inside a character or a byte-fallback run
        while prompt and (tok.decode(prompt).endswith("\ufffd") or prompt[-1] in tok.byte_fallback_ids):
            prompt.pop()
        check_stream(tok, ids, rng, prompt if n % 3 == 0 else None)


@pytest.fixture(scope="module")
def tokenizer(default_model_path) -> Tokenizer:
    return tokenizer_from_gguf(GGUFFile(default_model_path).metadata)


@pytest.fixture(scope="module")
def byte_ids(tokenizer) -> dict[int, int]:
    """Byte value -> id of its single-byte token (SmolLM2 lacks a few bytes that UTF-8 text never uses)."""
    ids = {b: tokenizer.token_to_id(c) for b, c in enumerate(byte_vocab())}
    return {b: i for b, i in ids.items() if i is not None}


def test_byte_level_bpe(tokenizer, byte_ids):
    fuzz(tokenizer, byte_ids, seed=0, cases=3000)


def test_sentencepiece_byte_fallback(spm):  # noqa: F811
    tok = tokenizer_from_gguf(GGUFFile(spm[1]).metadata)
    byte_ids = {b: tok.token_to_id(f"<0x{b:02X}>") for b in range(256)}
    assert None not in byte_ids.values() and tok.byte_fallback_ids == set(byte_ids.values())
    fuzz(tok, byte_ids, seed=1, cases=3000)


def test_byte_fallback_run_is_held_until_it_ends(spm):  # noqa: F811
    tok = tokenizer_from_gguf(GGUFFile(spm[1]).metadata)
    byte = {b: tok.token_to_id(f"<0x{b:02X}>") for b in range(256)}
    detok = IncrementalDetokenizer(tok.decode, None, tok.byte_fallback_ids)
    # "l" as a byte token is valid alone, but a following invalid byte turns the whole run into U+FFFDs
    assert [detok.push([byte[b]]) for b in (0x6C, 0xE6)] == ["", ""]
    the = tok.encode("the", add_special_tokens=False)
    assert detok.push(the) == tok.decode([byte[0x6C], byte[0xE6], *the]) == "\ufffd\ufffd the"


def test_split_character_waits_for_its_last_byte(tokenizer, byte_ids):
    detok = IncrementalDetokenizer(tokenizer.decode)
    pieces = [detok.push([byte_ids[b]]) for b in "a😀".encode()]
    assert pieces == ["a", "", "", "", "😀"]


def test_flush_releases_an_incomplete_tail(tokenizer, byte_ids):
    detok = IncrementalDetokenizer(tokenizer.decode)
    assert [detok.push([byte_ids[b]]) for b in (0x61, 0xF0, 0x9F)] == ["a", "", ""]
    assert detok.flush() == "\ufffd"
    assert detok.flush() == ""


def test_flush_with_nothing_pushed(tokenizer):
    assert IncrementalDetokenizer(tokenizer.decode, None, {1}).flush() == ""
    assert IncrementalDetokenizer(tokenizer.decode, tokenizer.encode("hi"), {1}).flush() == ""


def test_keeps_only_its_context_window():
    """A long generation keeps a few ids, not every one (only the last few are ever decoded again)."""
    words = [f"w{i} " for i in range(500)]
    detok = IncrementalDetokenizer(lambda ids: "".join(words[i] for i in ids), list(range(50)))
    shown = "".join(detok.push([i]) for i in range(500)) + detok.flush()
    assert shown == "".join(words)
    assert len(detok.ids) <= 2 * 6
