"""llguidance (our grammar engine) and xgrammar side by side on the default model's tokenizer (49,152 tokens):
tokenizer setup, schema compile, and the per-token mask cost while walking a valid JSON document, medians.

    pip install xgrammar   # optional: only this benchmark uses it
    python benchmarks/engine/grammar_engines.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import llguidance
import llguidance.torch as llg_torch

from edgeserve.loaders.gguf_file import GGUFFile
from edgeserve.loaders.tokenizer import tokenizer_from_gguf
from edgeserve.registry import DEFAULT_MODEL, pull

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb", "ccc"]}},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
DOC = json.dumps({"name": "Alice Smith the third", "age": 42, "tags": ["a", "ccc", "bb"],
                  "address": {"city": "Paris, France", "zip": "75001"}})


def _llguidance(tok, ids, vocab):
    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab, eos_token=sorted(tok.eot_ids))
    t1 = time.perf_counter()
    m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
    t2 = time.perf_counter()
    mask = llg_torch.allocate_token_bitmask(1, vocab)
    per = []
    for t in ids:
        s = time.perf_counter()
        llg_torch.fill_next_token_bitmask(m, mask, 0)
        per.append(time.perf_counter() - s)
        assert m.consume_token(t)
    return t1 - t0, t2 - t1, per


def _xgrammar(tok, ids, vocab):
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo([tok.id_to_token(i) or "" for i in range(vocab)], vocab_type=xgr.VocabType.BYTE_LEVEL,
                             vocab_size=vocab, stop_token_ids=sorted(tok.eot_ids))
    compiler = xgr.GrammarCompiler(info)
    t1 = time.perf_counter()
    gm = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA)))
    t2 = time.perf_counter()
    mask = xgr.allocate_token_bitmask(1, vocab)
    per = []
    for t in ids:
        s = time.perf_counter()
        gm.fill_next_token_bitmask(mask, 0)
        per.append(time.perf_counter() - s)
        assert gm.accept_token(t)
    return t1 - t0, t2 - t1, per


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    tok = tokenizer_from_gguf(GGUFFile(pull(DEFAULT_MODEL, progress=False)).metadata)
    vocab = 49152
    ids = tok.encode(DOC, add_special_tokens=False)
    engines = {"llguidance": _llguidance}
    try:
        import xgrammar  # noqa: F401

        engines["xgrammar"] = _xgrammar
    except ImportError:
        print("xgrammar not installed: llguidance only")
    print(f"vocab {vocab}, document of {len(ids)} tokens, {args.repeats} repeats")
    for name, fn in engines.items():
        runs = [fn(tok, ids, vocab) for _ in range(args.repeats)]
        setup = statistics.median(r[0] for r in runs)
        comp = statistics.median(r[1] for r in runs)
        per = [p for r in runs for p in r[2]]
        print(f"  {name:11s} tokenizer {setup * 1e3:7.1f} ms  compile {comp * 1e3:6.1f} ms  "
              f"mask median {statistics.median(per) * 1e6:6.1f} us  p90 {statistics.quantiles(per, n=10)[-1] * 1e6:7.1f} us"
              f"  max {max(per) * 1e6:7.1f} us")


if __name__ == "__main__":
    main()
