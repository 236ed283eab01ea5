"""XLM-RoBERTa's real 250002-token vocabulary as an XLM-R checkpoint folder ships it (bge-m3, bge-reranker-v2-m3):
`sentencepiece.bpe.model` plus the `tokenizer.json` / `tokenizer_config.json` transformers makes of it.

The SentencePiece model is rebuilt from llama.cpp's `models/ggml-vocab-nomic-bert-moe.gguf` (nomic-embed-text-v2-moe
uses XLM-R's tokenizer unchanged): the converter stored it in Hugging Face's order (`<s> <pad> </s> <unk>`, then
SentencePiece piece i at id i + 1, `<mask>` at 250001, padding after), so SentencePiece's own order is `<unk> <s>
</s>` followed by the GGUF's tokens 4 .. 250000, with their scores, types and the precompiled normalization map.
"""

from __future__ import annotations

import json
from pathlib import Path

from llama_cpp_source import llama_cpp_dir

XLMR_VOCAB = 250002  # XLMRobertaConfig.vocab_size of bge-m3 / bge-reranker-v2-m3
SPM_PIECES = XLMR_VOCAB - 2  # the SentencePiece model's pieces (Hugging Face adds <pad> and <mask>)


def xlmr_sentencepiece() -> bytes:
    """XLM-R's `sentencepiece.bpe.model` (a Unigram ModelProto) rebuilt from llama.cpp's nomic-bert-moe vocabulary."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    from edgeserve.loaders.gguf_file import GGUFFile

    md = GGUFFile(llama_cpp_dir() / "models" / "ggml-vocab-nomic-bert-moe.gguf").metadata
    tokens, scores, kinds = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.scores"], md["tokenizer.ggml.token_type"]
    model = pb.ModelProto()
    for piece, kind in (("<unk>", 2), ("<s>", 3), ("</s>", 3)):
        model.pieces.add(piece=piece, score=0.0, type=kind)
    for i in range(4, SPM_PIECES + 1):
        model.pieces.add(piece=tokens[i], score=float(scores[i]), type=int(kinds[i]))
    spec = model.trainer_spec
    spec.model_type = pb.TrainerSpec.UNIGRAM
    spec.vocab_size = len(model.pieces)
    spec.unk_id, spec.bos_id, spec.eos_id, spec.pad_id = 0, 1, 2, -1
    norm = model.normalizer_spec
    norm.name = "nmt_nfkc"
    norm.precompiled_charsmap = bytes(md["tokenizer.ggml.precompiled_charsmap"])
    norm.add_dummy_prefix = bool(md["tokenizer.ggml.add_space_prefix"])
    norm.remove_extra_whitespaces = bool(md["tokenizer.ggml.remove_extra_whitespaces"])
    norm.escape_whitespaces = True
    return model.SerializeToString()


def xlmr_tokenizer_folder(dest: Path, spm: bytes | None = None) -> Path:
    """`dest` with an XLM-R tokenizer's files: sentencepiece.bpe.model (XLM-R's own unless `spm`, a Unigram model, is
    given), and the tokenizer.json / tokenizer_config.json transformers' XLMRobertaTokenizer saves of it; its
    vocabulary is the model's pieces + 2 (`<pad>`, `<mask>`)."""
    from transformers import AutoTokenizer

    dest.mkdir(parents=True, exist_ok=True)
    (dest / "sentencepiece.bpe.model").write_bytes(xlmr_sentencepiece() if spm is None else spm)
    (dest / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "XLMRobertaTokenizer",
                                                            "model_max_length": 8192}))
    AutoTokenizer.from_pretrained(str(dest)).save_pretrained(dest)
    return dest
