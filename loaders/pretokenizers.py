"""How a byte-level BPE vocabulary from a GGUF file splits text before merging, by its `tokenizer.ggml.pre` name.

llama.cpp's converter names the pre-tokenizer of the original Hugging Face tokenizer (`tokenizer.ggml.pre`, found by
hashing what the tokenizer makes of a probe text) and llama.cpp maps each name to regexes (src/llama-vocab.cpp). We
map the same names to the splits the original `tokenizer.json` files make, written as Hugging Face `tokenizers`
pre-tokenizer steps (regexes run by its Oniguruma engine, so lookaheads, `(?i:...)`, possessive quantifiers and
class intersections are written as the originals write them, where llama.cpp has to rewrite some of them).
Each regex splits every piece the one before it made, keeping both the matches and the text between them
("Isolated"), which is what llama.cpp does with its list of regexes too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

Step = str | dict[str, Any]  # a regex (a Split, "Isolated") or a whole tokenizer.json pre-tokenizer step


@dataclass(frozen=True)
class PreTokenizer:
    """How a byte-level BPE vocabulary splits text before merging, and its other per-family settings."""

    splits: tuple[Step, ...]  # applied in turn, each splitting the pieces of the one before
    ignore_merges: bool = False  # a piece that is itself a token is taken whole (Llama 3's tokenizer.json)
    nfc: bool = False  # the original tokenizer.json normalizes to NFC (Qwen2); llama.cpp never does
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token
    byte_level: bool = True  # False: SentencePiece-style BPE over raw UTF-8 with spaces as ▁ (Gemma 4, Sarvam)


_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (  # Qwen2's with combining marks (\p{M}) kept inside words
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_KIMI_K2 = (  # tiktoken's pattern in Kimi K2's tokenization_kimi.py: Han runs apart, never inside a word
    r"[\p{Han}]+"
    rf"|[^\r\n\p{{L}}\p{{N}}]?[\p{{Lu}}\p{{Lt}}\p{{Lm}}\p{{Lo}}\p{{M}}&&[^\p{{Han}}]]*"
    rf"[\p{{Ll}}\p{{Lm}}\p{{Lo}}\p{{M}}&&[^\p{{Han}}]]+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?[\p{{Lu}}\p{{Lt}}\p{{Lm}}\p{{Lo}}\p{{M}}&&[^\p{{Han}}]]+"
    rf"[\p{{Ll}}\p{{Lm}}\p{{Lo}}\p{{M}}&&[^\p{{Han}}]]*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek V3 (and Hunyuan dense, JoyAI): digits in threes, then CJK runs, then words and punctuation.
_ASCII_PUNCT_WORD = r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"
_DEEPSEEK3_WORDS = (
    _ASCII_PUNCT_WORD + r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"  # DeepSeek LLM / Coder
# The cased letters DeepSeek LLM's tokenizer.json keeps together (with an optional leading space).
_DEEPSEEK_LETTERS = (
    "A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377"
    "\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
    "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb"
    "\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4"
    "\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_DEEPSEEK_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
_PORO = r" ?[^(\s|.,!?…。，、।۔،)]+"
_BYTE_LEVEL_GPT2 = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}

_GPT2_PRE = PreTokenizer((_GPT2,))
_DIGITS_GPT2_PRE = PreTokenizer((r"\p{N}", _GPT2))
_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_PRE = PreTokenizer((_QWEN2,), nfc=True)  # Qwen2's tokenizer.json normalizes to NFC
_QWEN2_SPLIT_PRE = PreTokenizer((_QWEN2,))  # the same regex in tiktoken-based vocabularies (no normalizer)
_DEEPSEEK3_PRE = PreTokenizer((r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3_WORDS))
_GPT4O_PRE = PreTokenizer((_GPT4O,))
_SPM_STYLE_PRE = PreTokenizer((), byte_level=False)

# `tokenizer.ggml.pre` names as llama.cpp's convert_hf_to_gguf.py writes them.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    # llama.cpp's fallback for a file without a name (Falcon's splits, roughly)
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    **dict.fromkeys(
        ["gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "gigachat", "a.x-4.0", "mellum", "exaone4",
         "granite-docling", "modern-bert", "roberta-bpe", "jina-es", "jina-de", "jina-v1-en", "jina-v2-es",
         "jina-v2-de", "jina-v2-code"],
        _GPT2_PRE,
    ),  # fmt: skip
    **dict.fromkeys(
        ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"],
        _DIGITS_GPT2_PRE,
    ),
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "lfm2", "midm-2.0", "jina-v5-nano"],
        _LLAMA3_PRE,
    ),
    **dict.fromkeys(["dbrx", "smaug-bpe", "chatglm-bpe"], PreTokenizer((_LLAMA3,))),
    **dict.fromkeys(["glm4", "glm5"], PreTokenizer((_LLAMA3,), ignore_merges=True)),
    "jais-2": PreTokenizer((  # Llama 3's, but long runs of spaces split in powers of two
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)"
        r"|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}",
    )),  # fmt: skip
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "stablelm2", "megrez", "f2llmv2"], _QWEN2_PRE),
    **dict.fromkeys(["hunyuan", "solar-open", "grok-2"], _QWEN2_SPLIT_PRE),
    "qwen35": PreTokenizer((_QWEN35,)),  # Qwen3.5 / 3.6: no normalizer (decomposed accents stay decomposed)
    "ufakzeka": PreTokenizer((_QWEN2.removeprefix(_CONTRACTIONS + "|"),)),  # Turkish suffixes after ' stay on
    "laguna": PreTokenizer((r"[^\n]+|[\n]+", _QWEN2)),
    "minicpm5": PreTokenizer(
        (r"\p{N}{1,3}", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s+(?!\S)|\s+"),
        ignore_merges=True,
    ),  # fmt: skip
    "seed-coder": PreTokenizer(
        (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",)
    ),
    **dict.fromkeys(["bailingmoe", "bailingmoe2", "llada-moe"], PreTokenizer((
        r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    ))),  # fmt: skip
    "exaone-moe": PreTokenizer((
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
        r"|\s*[\r\n]|\s+(?!\S)|\s+",
    )),  # fmt: skip
    "tekken": PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O_PRE),
    "granite-embed-multi-97m": PreTokenizer((_GPT4O,), ignore_merges=True),
    **dict.fromkeys(["tiny_aya", "cohere2moe"], PreTokenizer((r"\d{1,3}(?=(?:\d{3})*\b)", _GPT4O))),
    "youtu": PreTokenizer(
        ("[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001"
         "-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
         _GPT4O.replace(r"\p{N}{1,3}", r"\p{N}")),
        ignore_merges=True,
    ),  # fmt: skip
    "kimi-k2": PreTokenizer((_KIMI_K2,)),
    **dict.fromkeys(["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"], _DEEPSEEK3_PRE),
    "spark2_5": PreTokenizer((
        r"\p{N}{1,3}", _CJK_KANA,
        _ASCII_PUNCT_WORD + r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+", r"\p{N}",
    )),  # fmt: skip
    "afmoe": PreTokenizer((
        r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))",  # digit runs in threes counted from the right: 1 234 567
        # CJK, kana, Thai, Lao, Khmer, Myanmar, Hangul runs. U+F900-U+FAFF is the CJK compatibility block;
        # llama.cpp's source writes its first character NFC-normalized (U+8C48), which widens the range.
        "[\u4e00-\u9fff\u3400-\u4dbf\uf900-\ufaff\u3040-\u309f\u30a0-\u30ff\uff65-\uff9f\u2f00-\u2fdf"
        "\u0e40-\u0e7f\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f\uaa60-\uaa7f\ua9e0-\ua9ff\uac00-\ud7af\u1100-\u11ff]+",
        _DEEPSEEK3_WORDS,
    )),  # fmt: skip
    "deepseek-llm": PreTokenizer(
        (r"[\r\n]", "\\s?[" + _DEEPSEEK_LETTERS + "]+", _DEEPSEEK_PUNCT, r"\s+$", _CJK_HANGUL, r"\p{N}+")
    ),
    "deepseek-coder": PreTokenizer((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}")),
    # Falcon's tokenizer.json: punctuation runs, then GPT-2's byte-level split, then digit runs in threes
    "falcon": PreTokenizer((
        {"type": "Punctuation", "behavior": "Contiguous"}, _BYTE_LEVEL_GPT2,
        {"type": "Digits", "individual_digits": False}, r"[0-9][0-9][0-9]",
    )),  # fmt: skip
    **dict.fromkeys(["poro-chat", "bloom", "gpt3-finnish"], PreTokenizer((_PORO,))),
    "viking": PreTokenizer((_PORO, r"\p{N}")),
    "chameleon": PreTokenizer(
        (r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )", r"\p{N}",
         r"[\p{P}!-/:-@\[-`{-~]", _GPT2),
        add_bos=True,
    ),  # fmt: skip
    "superbpe": PreTokenizer((r"\p{N}+", r"(?=(\d{3})+(?!\d))")),
    **dict.fromkeys(["gemma4", "granite-embed-multi-311m", "sarvam-moe"], _SPM_STYLE_PRE),
}


def pre_tokenizer_for(name: str | None) -> PreTokenizer:
    """The pre-tokenizer for a `tokenizer.ggml.pre` name ('default' when absent); an unknown name is warned about
    (naming it) and split the GPT-2 way."""
    pre = PRE_TOKENIZERS.get(name or "default")
    if pre is None:
        log.warning("unknown GGUF pre-tokenizer %r; splitting text the GPT-2 way", name)
        return _GPT2_PRE
    return pre


def pre_tokenizer_steps(pre: PreTokenizer) -> list[dict[str, Any]]:
    """tokenizer.json pre-tokenizer steps for `pre`, ending in the byte-level mapping (without GPT-2's regex,
    unless a step asks for it)."""
    steps = [
        {"type": "Split", "pattern": {"Regex": s}, "behavior": "Isolated", "invert": False} if isinstance(s, str)
        else s
        for s in pre.splits
    ]  # fmt: skip
    if not any(s.get("type") == "ByteLevel" for s in steps):
        steps.append({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False})
    return steps
