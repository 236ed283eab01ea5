"""GGUF tokenizers against llama.cpp's own tokenizer test vectors.

llama.cpp ships vocabulary-only GGUF files (`models/ggml-vocab-*.gguf`) with `.inp` / `.out` files made from the
original Hugging Face tokenizers: inputs separated by a marker line, one line of expected ids per input. Its test
(tests/test-tokenizer-0.cpp) tokenizes each input with no BOS/EOS added and special tokens not parsed, and compares
the ids. We do the same, and also decode the ids back to the input where the vocabulary is lossless.
The files are read from the cached llama.cpp reference folder (tests/llama_cpp_source.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from edgeserve.loaders import tokenizer as tokenizer_module
from edgeserve.loaders.gguf_file import GGUFFile
from edgeserve.loaders.pretokenizers import PRE_TOKENIZERS
from edgeserve.loaders.tokenizer import Tokenizer, tokenizer_from_gguf

from tests.llama_cpp_source import llama_cpp_dir

SEPARATOR = "\n__ggml_vocab_test__\n"
# WordPiece lowercases, strips accents and drops whitespace: its ids do not decode back to the input.
LOSSY_VOCABULARIES = {"bert-bge"}


def _models_dir() -> Path:
    return llama_cpp_dir() / "models"


def _vocabularies() -> list[str]:
    """Names of the vocabularies with test vectors ('qwen35' for ggml-vocab-qwen35.gguf)."""
    files = sorted(_models_dir().glob("ggml-vocab-*.gguf"))
    names = [f.name.removeprefix("ggml-vocab-").removesuffix(".gguf") for f in files]
    return [n for n, f in zip(names, files) if Path(f"{f}.inp").is_file() and Path(f"{f}.out").is_file()]


def read_vectors(gguf: Path) -> dict[str, list[int]]:
    """Input text -> expected ids, read as test-tokenizer-0.cpp reads them (a repeated input keeps its last ids)."""
    text = Path(f"{gguf}.inp").read_bytes().decode("utf-8")
    inputs = text.removesuffix(SEPARATOR).split(SEPARATOR)
    outputs = Path(f"{gguf}.out").read_bytes().decode("utf-8").split("\n")
    outputs = outputs[:-1] if outputs and outputs[-1] == "" else outputs
    assert len(inputs) == len(outputs), f"{gguf.name}: {len(inputs)} inputs but {len(outputs)} expected outputs"
    return {s: [int(t) for t in o.split()] for s, o in zip(inputs, outputs)}


@pytest.fixture(scope="module", params=_vocabularies())
def vocabulary(request) -> tuple[str, Tokenizer, dict[str, list[int]]]:
    gguf = _models_dir() / f"ggml-vocab-{request.param}.gguf"
    with pytest.MonkeyPatch.context() as mp:  # built afresh: a cached tokenizer would hide a change to the builder
        mp.setattr(tokenizer_module, "cached_tokenizer", lambda key, build: build())
        tokenizer = tokenizer_from_gguf(GGUFFile(gguf).metadata)
    tokenizer.backend.encode_special_tokens = True  # llama.cpp's test tokenizes with parse_special = false
    return request.param, tokenizer, read_vectors(gguf)


def test_every_input_encodes_to_the_reference_ids(vocabulary):
    name, tokenizer, vectors = vocabulary
    assert len(vectors) >= 40
    wrong = {
        text: (expected, got)
        for text, expected in vectors.items()
        if (got := tokenizer.encode(text, add_special_tokens=False)) != expected
    }
    assert not wrong, f"{name}: {len(wrong)} of {len(vectors)} inputs differ, e.g. {next(iter(wrong.items()))!r}"


def test_reference_ids_decode_to_the_input(vocabulary):
    name, tokenizer, vectors = vocabulary
    if name in LOSSY_VOCABULARIES:
        pytest.skip(f"{name} is a lossy (normalizing) vocabulary")
    wrong = {text: decoded for text, ids in vectors.items() if (decoded := tokenizer.decode(ids)) != text}
    assert not wrong, f"{name}: {len(wrong)} of {len(vectors)} decode differently, e.g. {next(iter(wrong.items()))!r}"


def test_every_vocabulary_the_folder_has_vectors_for_is_tested():
    # The vectors the issue names, so a folder that lost some files is noticed rather than silently tested less.
    assert {"qwen35", "deepseek-llm", "deepseek-coder", "falcon", "llama-bpe", "gemma-4"} <= set(_vocabularies())


# Names the converter writes for vocabularies that are not byte-level BPE (tokenizer.ggml.pre is not read for
# them), or for a tokenizer model edgeserve does not load ('whitespace').
NOT_BYTE_LEVEL_BPE = {"bert-bge", "bert-bge-large", "jina-v2-en", "chatglm-spm", "whitespace"}


def test_every_pre_tokenizer_name_the_converter_writes_is_known():
    conversion = llama_cpp_dir() / "conversion"
    source = "\n".join(p.read_text(encoding="utf-8") for p in sorted(conversion.glob("*.py")))
    names = set(re.findall(r'\bres = "([^"]+)"', source)) | set(re.findall(r'add_tokenizer_pre\("([^"]+)"\)', source))
    assert len(names) > 60  # the hash table was found
    assert sorted(names - NOT_BYTE_LEVEL_BPE - PRE_TOKENIZERS.keys()) == []
