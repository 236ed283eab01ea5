"""The Gemma 3 tokenizer we build from the GGUF vocabulary (gemma3-270m) against the one transformers builds from
the same GGUF: the same ids for English, code, other scripts, whitespace runs, special tokens and byte fallback."""

from __future__ import annotations

import os

import pytest

from edgeserve.loaders.gguf_file import GGUFFile
from edgeserve.loaders.tokenizer import tokenizer_from_gguf

pytestmark = pytest.mark.slow

CORPUS = [
    # English
    "Hello world", "The quick brown fox jumps over the lazy dog.", "It's a well-known fact; isn't it? Yes!",
    "Mr. O'Neil paid $1,234.56 on 2024-03-15 at 10:30am (about 3.5% more).",
    # code
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    "const x = {a: 1, 'b': [2, 3], \"c\": null}; // comment\n/* block */",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;",
    "https://example.com/path?q=a+b&x=%20y#frag user@example.org",
    # other scripts
    "Привет, мир! Как дела?", "你好，世界。今天天气很好。", "こんにちは、世界！カタカナとひらがな。",
    "안녕하세요 세계", "مرحبا بالعالم", "नमस्ते दुनिया", "สวัสดีชาวโลก", "Ελληνικά και Türkçe, naïve café, Straße",
    "emoji 🤖🎉 family 👨‍👩‍👧 flag 🇫🇷 skin 👍🏽",
    # whitespace runs
    "a  b   c    d     e", "line1\n\nline2\n\n\n\nline3", "\t\ttabs\t \t mixed", "   leading", "trailing   ",
    " ", "  ", "\n", "\n\n\n", "\r\n windows\r\n", "\u00a0nbsp\u2003em\u200bzero-width", "x" + " " * 31 + "y",
    # special tokens and look-alikes
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n", "<bos>text<eos>",
    "<pad><unk><mask>", "<start_of_image> and <end_of_image>", "<start_of_turn", "< start_of_turn >",
    "<b>bold</b> <div class=\"x\">",
    # byte fallback and digits
    "\x00\x01\x07 control", "𠜎𠜱𝕏 rare", "1234567890 3.14159 -42 1e-10 0x1F", "a" * 42,
]


@pytest.fixture(scope="module")
def gemma_gguf():
    from edgeserve.registry import pull

    return pull("gemma3-270m", progress=False)


@pytest.fixture(scope="module")
def ours(gemma_gguf):
    return tokenizer_from_gguf(GGUFFile(gemma_gguf).metadata)


@pytest.fixture(scope="module")
def theirs(gemma_gguf):
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return transformers.AutoTokenizer.from_pretrained(str(gemma_gguf.parent), gguf_file=gemma_gguf.name)


@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_same_ids_as_transformers(ours, theirs, add_special_tokens: bool) -> None:
    for text in CORPUS:
        assert ours.encode(text, add_special_tokens) == theirs.encode(text, add_special_tokens=add_special_tokens), text


def test_whitespace_runs_longer_than_any_token_split_longest_first(ours) -> None:
    """Gemma's whitespace-run tokens (up to 31 spaces) are user-defined pieces, which SentencePiece and llama.cpp match
    longest first: 40 spaces are 31 + 9. (transformers' tokenizer built from the GGUF splits them 16 + 24, unlike
    the SentencePiece model it stands for, so this case is checked against the rule instead.)"""
    runs = {len(t): i for t, i in ours.backend.get_vocab().items() if t and set(t) == {" "}}
    assert max(runs) == 31
    for n in (33, 40, 62, 70):  # the last piece at least 2 spaces (a single one is `▁`, which merges on)
        expected, left = [], n
        while left:
            take = max(k for k in runs if k <= left)
            expected.append(runs[take])
            left -= take
        assert ours.encode("x" + " " * n + "y", add_special_tokens=False)[1:-1] == expected, n


def test_the_corpus_reaches_what_it_should(ours) -> None:
    """The corpus is not trivially easy: it holds special tokens, byte-fallback tokens and whitespace-run tokens."""
    ids = {t for text in CORPUS for t in ours.encode(text, add_special_tokens=False)}
    assert ours.token_to_id("<start_of_turn>") in ids and ours.token_to_id("<end_of_turn>") in ids
    assert ids & ours.byte_fallback_ids
    assert any(ours.id_to_token(t) in ("▁▁▁", "\n\n\n", "\t\t") for t in ids)
    # and our decode gives the text back where the vocabulary can spell it
    assert ours.decode(ours.encode(CORPUS[4], add_special_tokens=False)) == CORPUS[4]
