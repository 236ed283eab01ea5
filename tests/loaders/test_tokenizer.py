"""Tokenizers from GGUF metadata and Hugging Face folders, checked against transformers and sentencepiece."""

from __future__ import annotations

import io
import os
import json

import numpy as np
import pytest
from tokenizers import Tokenizer as HFBackend
from tokenizers import decoders, processors

from edgeserve.errors import ModelLoadError, UnsupportedModelError
from edgeserve.loaders.gguf_file import GGUFFile
from edgeserve.loaders.pretokenizers import PRE_TOKENIZERS
from edgeserve.loaders.tokenizer import (
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNKNOWN,
    TOKEN_UNUSED,
    TOKEN_USER_DEFINED,
    Tokenizer,
    tokenizer_from_gguf,
    tokenizer_from_hf_folder,
)

from support.gguf_writer import finish

CORPUS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's fine, but WE'LL see. Don't.",
    'def square(x: int) -> int:\n    """Square."""\n    return x ** 2  # done\n',
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
    "a  b   c    d",
    "tabs\tand\t\ttabs\t",
    "lines\n\n\nand\r\nwindows\r\n",
    "  leading spaces",
    "trailing spaces   ",
    " \t \n mixed \n\t  whitespace\t \n",
    " ",
    "\n",
    "",
    "日本語のテキストと中文文本。한국어도.",
    "emoji 😀🎉 family 👩‍👩‍👧 flag 🇫🇷",
    "café naïve Zürich São Paulo Ångström crème brûlée",
    "1234567890 3.14159 -42 1,000,000 0x1F 2024-06-01",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more<|endoftext|>",
    "a <|im_start|> b",
]


# ------------------------------------------------------------------------------------------------------------------
# The real model's byte-level BPE tokenizer (tokenizer.ggml.model = 'gpt2', pre = 'smollm')


@pytest.fixture(scope="module")
def metadata(default_model_path):
    return GGUFFile(default_model_path).metadata


@pytest.fixture(scope="module")
def tokenizer(metadata) -> Tokenizer:
    return tokenizer_from_gguf(metadata)


@pytest.mark.parametrize("text", CORPUS)
def test_encode_decode_match_transformers(tokenizer, reference_tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids == reference_tokenizer.encode(text)
    assert tokenizer.decode(ids) == reference_tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == reference_tokenizer.decode(ids, skip_special_tokens=True)


def test_decode_random_ids_matches_transformers(tokenizer, reference_tokenizer):
    rng = np.random.default_rng(0)
    for _ in range(200):
        ids = rng.integers(0, tokenizer.vocab_size, size=int(rng.integers(1, 48))).tolist()
        ids += rng.integers(0, 17, size=2).tolist()  # make sure special tokens show up
        for skip in (False, True):
            assert tokenizer.decode(ids, skip) == reference_tokenizer.decode(ids, skip_special_tokens=skip), ids


def test_special_tokens(tokenizer, reference_tokenizer):
    assert tokenizer.vocab_size == 49152
    assert (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)
    assert (tokenizer.bos_token, tokenizer.eos_token) == (reference_tokenizer.bos_token, reference_tokenizer.eos_token)
    assert tokenizer.eot_ids == {tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")}
    assert not tokenizer.add_bos
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 5


def test_add_bos_flag(metadata):
    tok = tokenizer_from_gguf({**metadata, "tokenizer.ggml.add_bos_token": True})
    assert tok.encode("hi") == [tok.bos_id, *tok.encode("hi", add_special_tokens=False)]


def test_decode_stream_joins_to_decode(tokenizer):
    text = "Streaming: 日本語 😀 café\n"
    ids = tokenizer.encode(text)
    step = tokenizer.decode_stream()
    assert "".join(map(step, ids)) == tokenizer.decode(ids) == text


# ------------------------------------------------------------------------------------------------------------------
# Pre-tokenizers selected by tokenizer.ggml.pre


def _pre_metadata(pre: str | None) -> dict:
    tokens = ["<|endoftext|>", "a", "b", "ab"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [TOKEN_CONTROL] + [TOKEN_NORMAL] * 3,
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.eos_token_id": 0,
    }
    return meta if pre is None else {**meta, "tokenizer.ggml.pre": pre}


def _pieces(pre: str | None, text: str) -> list[str]:
    backend = tokenizer_from_gguf(_pre_metadata(pre)).backend
    unbyte = decoders.ByteLevel()
    return [unbyte.decode([piece]) for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize(
    "pre, text, pieces",
    [
        ("gpt2", "Hi 12345 x", ["Hi", " 12345", " x"]),
        ("smollm", "Hi 12345 x", ["Hi", " ", "1", "2", "3", "4", "5", " x"]),
        ("llama-bpe", "Hi 12345 x", ["Hi", " ", "123", "45", " x"]),
        ("llama-bpe", "WE'LL  go\n\nok", ["WE", "'LL", " ", " go", "\n\n", "ok"]),
        ("qwen2", "Hi 12345 x", ["Hi", " ", "1", "2", "3", "4", "5", " x"]),
        ("qwen2", "I'M ok", ["I", "'M", " ok"]),
        ("qwen35", "Hi 12345 x", ["Hi", " ", "1", "2", "3", "4", "5", " x"]),
        ("qwen35", "नमस्ते ok", ["नमस्ते", " ok"]),  # combining marks stay in the word (Qwen3.5's regex)
        ("qwen2", "नमस्ते ok", ["नमस", "्त", "े", " ok"]),
        ("gpt2", "I'M ok", ["I", "'", "M", " ok"]),  # GPT-2's contractions are case-sensitive
        (None, "x=1234567!", ["x", "=", "123", "456", "7", "!"]),  # llama.cpp's 'default'
        ("falcon", "\n =3333", ["\n ", "=", "333", "3"]),  # punctuation runs first, digits in threes
        ("deepseek-llm", "ied 4 ½ months", ["ied", " ", "4", " ", "½", " months"]),
        ("deepseek-coder", "ab12 ½", ["ab", "1", "2", " ", "½"]),
        ("deepseek-v3", "Hello 1234567 世界ok.Go", ["Hello", " ", "123", "456", "7", " ", "世界", "ok", ".Go"]),
        ("kimi-k2", "我想在apple工作 It's", ["我想在", "apple", "工作", " It's"]),  # Han never inside a word
        ("afmoe", "x1234567 12", ["x", "1", "234", "567", " ", "12"]),  # threes counted from the right
        ("gpt-4o", "HelloWorld I'M", ["Hello", "World", " I'M"]),
    ],
)
def test_pre_tokenizer_splits(pre, text, pieces):
    assert _pieces(pre, text) == pieces


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_every_pre_tokenizer_builds_and_keeps_the_text(pre, tmp_path, monkeypatch):
    # Every regex compiles in tokenizers' engine, and the pieces join back to the text (nothing dropped or doubled)
    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path))  # ~60 throwaway tokenizers stay out of the user's cache
    text = "Hello, y'all! 我想在apple工作 1234567 ½ naïve e\u0301 한국어\n\n\t  <sentinel:3> x=3333!!"
    backend = tokenizer_from_gguf(_pre_metadata(pre)).backend
    if not PRE_TOKENIZERS[pre].byte_level:
        assert backend.pre_tokenizer is None
        return
    pieces = [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text)]  # byte-level spelled
    assert decoders.ByteLevel().decode(pieces) == text and len(pieces) > 5


def test_qwen35_keeps_decomposed_accents():
    # Qwen3.5's tokenizer.json has no normalizer (Qwen2's normalizes to NFC): "e" + U+0301 stays two characters
    assert json.loads(tokenizer_from_gguf(_pre_metadata("qwen35")).backend.to_str())["normalizer"] is None
    assert json.loads(tokenizer_from_gguf(_pre_metadata("qwen2")).backend.to_str())["normalizer"] == {"type": "NFC"}


def test_sentencepiece_style_bpe_under_gpt2():
    # 'sarvam-moe': a 'gpt2' vocabulary of raw UTF-8 pieces with ▁ for spaces and no dummy prefix (as Gemma 4's)
    meta = {
        **_pre_metadata("sarvam-moe"),
        "tokenizer.ggml.tokens": ["<unk>", "▁", "a", "b", "▁a", "ab"],
        "tokenizer.ggml.token_type": [TOKEN_UNKNOWN] + [TOKEN_NORMAL] * 5,
        "tokenizer.ggml.merges": ["▁ a", "a b"],
        "tokenizer.ggml.eos_token_id": 0,
    }
    tok = tokenizer_from_gguf(meta)
    assert tok.encode("ab a", add_special_tokens=False) == [5, 4]
    assert tok.decode([5, 4]) == "ab a"


def test_llama3_ignores_merges_for_whole_words():
    spec = json.loads(tokenizer_from_gguf(_pre_metadata("llama-bpe")).backend.to_str())
    assert spec["model"]["ignore_merges"] is True
    assert json.loads(tokenizer_from_gguf(_pre_metadata("smollm")).backend.to_str())["model"]["ignore_merges"] is False


def test_unknown_pre_tokenizer_falls_back_to_gpt2(caplog):
    assert _pieces("no-such-pre", "Hi 12345 x") == _pieces("gpt2", "Hi 12345 x")
    assert "no-such-pre" in caplog.text


def test_unsupported_tokenizer_model():
    with pytest.raises(UnsupportedModelError, match="'rwkv'"):  # ('bert' and 't5' are supported now)
        tokenizer_from_gguf({**_pre_metadata("gpt2"), "tokenizer.ggml.model": "rwkv"})


def test_missing_tokenizer_metadata():
    with pytest.raises(ModelLoadError):
        tokenizer_from_gguf({"general.architecture": "llama"})
    with pytest.raises(ModelLoadError, match="merges"):
        tokenizer_from_gguf({k: v for k, v in _pre_metadata("gpt2").items() if k != "tokenizer.ggml.merges"})


# ------------------------------------------------------------------------------------------------------------------
# SentencePiece vocabulary (tokenizer.ggml.model = 'llama'): a tiny model trained here, exported into a GGUF

SPM_TRAINING_TEXT = """The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.
Tokenizers split text into pieces; byte fallback covers the rest. Numbers like 42 and 3.14 appear too.
def main():
    print("hello, world")
    return 0
café résumé naïve über straße
"""

SPM_CORPUS = [c for c in CORPUS if "<|" not in c] + ["The lazy dog jumps.", "  two leading", "x\u2581y", "<0x41>"]


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    """`(sentencepiece processor, GGUF path)`: a byte-fallback BPE model and the same vocabulary as a GGUF."""
    import gguf
    import sentencepiece as spm_lib

    model = io.BytesIO()
    spm_lib.SentencePieceTrainer.train(
        sentence_iterator=iter(SPM_TRAINING_TEXT.splitlines() * 20), model_writer=model, model_type="bpe",
        vocab_size=420, byte_fallback=True, character_coverage=1.0, split_digits=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
        allow_whitespace_only_pieces=True, user_defined_symbols=["<|user|>"], num_threads=1, minloglevel=2,
    )  # fmt: skip
    sp = spm_lib.SentencePieceProcessor(model_proto=model.getvalue())
    n = sp.get_piece_size()
    tokens = [sp.id_to_piece(i) for i in range(n)]
    types = [
        TOKEN_UNKNOWN if sp.is_unknown(i) else TOKEN_CONTROL if sp.is_control(i) else TOKEN_BYTE if sp.is_byte(i)
        else TOKEN_UNUSED if sp.is_unused(i) else TOKEN_USER_DEFINED if tokens[i] == "<|user|>" else TOKEN_NORMAL
        for i in range(n)
    ]  # fmt: skip

    path = tmp_path_factory.mktemp("spm") / "tiny-spm.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_tensor("token_embd.weight", np.zeros((n, 8), dtype=np.float32))  # transformers wants one tensor
    finish(w)
    return sp, path


@pytest.fixture(scope="module")
def spm_tokenizer(spm) -> Tokenizer:
    return tokenizer_from_gguf(GGUFFile(spm[1]).metadata)


@pytest.fixture(scope="module")
def spm_reference(spm):
    import transformers

    path = spm[1]
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_spm_vocab_shape(spm, spm_tokenizer):
    sp, _ = spm
    assert "<0x00>" in (sp.id_to_piece(i) for i in range(sp.get_piece_size()))
    assert spm_tokenizer.vocab_size == sp.get_piece_size()
    assert (spm_tokenizer.bos_token, spm_tokenizer.eos_token) == ("<s>", "</s>")
    assert spm_tokenizer.add_bos and spm_tokenizer.eot_ids == {sp.eos_id()}


@pytest.mark.parametrize("text", SPM_CORPUS)
def test_spm_matches_sentencepiece(spm, spm_tokenizer, text):
    sp, _ = spm
    ids = spm_tokenizer.encode(text, add_special_tokens=False)
    assert ids == sp.encode(text)
    assert spm_tokenizer.decode(ids) == sp.decode(ids) == text.replace("\u2581", " ")  # ▁ is how SPM spells a space
    assert spm_tokenizer.encode(text) == [sp.bos_id(), *ids]


@pytest.mark.parametrize("text", SPM_CORPUS)
def test_spm_matches_transformers(spm_tokenizer, spm_reference, text):
    ids = spm_tokenizer.encode(text)
    assert spm_tokenizer.decode(ids) == spm_reference.decode(ids)
    if text.startswith(" "):
        # transformers' GGUF conversion uses a Metaspace pre-tokenizer that adds no dummy prefix before text
        # that already starts with a space; sentencepiece (and llama.cpp, and we) always add it.
        assert ids != spm_reference.encode(text)
    else:
        assert ids == spm_reference.encode(text)


def test_spm_decode_random_ids_matches_transformers(spm_tokenizer, spm_reference):
    rng = np.random.default_rng(1)
    for _ in range(200):
        ids = rng.integers(0, spm_tokenizer.vocab_size, size=int(rng.integers(1, 30))).tolist()
        for skip in (False, True):
            assert spm_tokenizer.decode(ids, skip) == spm_reference.decode(ids, skip_special_tokens=skip), ids


def test_spm_special_tokens_in_text(spm, spm_tokenizer):
    sp, _ = spm
    # Control tokens written in the text are single ids; the text after one gets the dummy prefix again, as
    # it would if the model's sequence were built as [bos] + sentencepiece.encode(text).
    assert spm_tokenizer.encode("<s>hi there</s>", add_special_tokens=False) == [1, *sp.encode("hi there"), 2]
    # A user-defined piece stays whole, as sentencepiece keeps it.
    ids = spm_tokenizer.encode("x <|user|> y", add_special_tokens=False)
    assert ids[: ids.index(sp.piece_to_id("<|user|>")) + 1] == sp.encode("x <|user|>")


def test_spm_without_space_prefix(spm):
    meta = {**GGUFFile(spm[1]).metadata, "tokenizer.ggml.add_space_prefix": False}
    tok = tokenizer_from_gguf(meta)
    ids = tok.encode("quick fox", add_special_tokens=False)
    assert not tok.id_to_token(ids[0]).startswith("\u2581")
    assert tok.decode(ids) == "quick fox"


# ------------------------------------------------------------------------------------------------------------------
# Hugging Face folders


@pytest.fixture(scope="module")
def hf_folder(reference_tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    reference_tokenizer.save_pretrained(folder)
    return folder


def test_hf_folder_matches_gguf(hf_folder, tokenizer):
    tok = tokenizer_from_hf_folder(hf_folder)
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.vocab_size) == (1, 2, False, 49152)
    assert tok.eot_ids == tokenizer.eot_ids
    for text in CORPUS:
        assert tok.encode(text) == tokenizer.encode(text)


def test_hf_folder_generation_config_and_bos(hf_folder, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((hf_folder / name).read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    assert tokenizer_from_hf_folder(tmp_path).eot_ids == {0, 2, 3}

    # No add_bos_token in tokenizer_config.json: the tokenizer.json post-processor decides.
    backend = HFBackend.from_file(str(tmp_path / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    backend.save(str(tmp_path / "tokenizer.json"))
    tok = tokenizer_from_hf_folder(tmp_path)
    assert tok.add_bos and tok.encode("hi") == [1, *tok.encode("hi", add_special_tokens=False)]

    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
    assert not tokenizer_from_hf_folder(tmp_path).add_bos


def test_hf_folder_without_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        tokenizer_from_hf_folder(tmp_path)


def test_a_gguf_tokenizer_is_built_once_then_read_from_the_cache(spm, tmp_path, monkeypatch):
    """The tokenizer built from GGUF metadata (seconds for Gemma's 262k-token vocabulary) is cached under the
    edgeserve home by a digest of that metadata: the next load reads it back with the same ids, other metadata
    gets its own entry, and a damaged entry is rebuilt."""
    import edgeserve.loaders.tokenizer as tok_module

    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path))
    metadata = dict(GGUFFile(spm[1]).metadata)
    text = "Hello <|user|> wörld 123"
    built = tokenizer_from_gguf(metadata)
    [entry] = (tmp_path / "tokenizers").glob("*.json")

    def no_build(*args, **kwargs):
        raise AssertionError("built again instead of read from the cache")

    with monkeypatch.context() as m:
        m.setattr(tok_module, "spm_merges", no_build)
        cached = tokenizer_from_gguf(metadata)
    assert cached.encode(text) == built.encode(text) and cached.eot_ids == built.eot_ids
    assert cached.decode(built.encode(text)) == built.decode(built.encode(text))

    tokenizer_from_gguf({**metadata, "tokenizer.ggml.add_space_prefix": False})  # other metadata, another entry
    [other] = set((tmp_path / "tokenizers").glob("*.json")) - {entry}
    os.utime(other, (1e9, 1e9))  # used long ago (explicit: file times may be coarse)

    entry.write_text(entry.read_text()[:100])  # truncated
    assert tokenizer_from_gguf(metadata).encode(text) == built.encode(text)
    with monkeypatch.context() as m:
        m.setattr(tok_module, "spm_merges", no_build)
        assert tokenizer_from_gguf(metadata).encode(text) == built.encode(text)  # the rebuilt entry is whole

    monkeypatch.setattr(tok_module, "TOKENIZER_CACHE_ENTRIES", 2)  # the cache keeps the most recently used
    tokenizer_from_gguf({**metadata, "tokenizer.ggml.add_bos_token": False})  # a third entry: the oldest goes
    kept = list((tmp_path / "tokenizers").glob("*.json"))
    assert len(kept) == 2 and entry in kept and other not in kept
