"""Constrained decoding: grammars (JSON schema, any JSON, Lark) compiled once per tokenizer, a state per request.

The grammar engine is llguidance (https://github.com/guidance-ai/llguidance): no Python dependencies, it reads our
`tokenizers.Tokenizer` as JSON directly (GGUF-rebuilt vocabularies included), names unsupported JSON-schema keywords,
and computes a 49k-token mask in ~25 us per token (benchmarks/engine/grammar_engines.py compares it with xgrammar).

- `GrammarSpec`: what a request asks for (hashable: the compile cache key).
- `GrammarCompiler`: per tokenizer; `compile(spec)` validates and builds a template matcher once (LRU cache);
  `start(spec)` hands a request its own `GrammarState` (a cheap copy of the template).
- `GrammarState`: advances with accepted tokens; `fill_masks` computes the allowed-token bitmasks of a batch of
  states in one native call (threads inside llguidance), `allowed_mask` turns them into one bool tensor.

End-of-turn tokens are the grammar's EOS: the mask allows them only where the grammar may end.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Callable

import llguidance

from edgeserve.text.harmony import answer_frame

# whitespace between JSON tokens: compact, so a small model cannot spend its max_tokens on newlines
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """The grammar or schema cannot be compiled (the message names the unsupported feature)."""


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on a request's output.

    kind: "json_schema" (source: the schema as JSON text), "json_object" (any JSON object; source ignored),
    "lark" (source: a Lark grammar in llguidance's dialect) or "regex".
    think: (open, close) reasoning tags when the model may think first: the text up to `close` is free, the
    constraint applies after it (structured output applies to the answer, not to the reasoning); open is ""
    when the prompt already opened the reasoning. Tags are matched as text (Qwen3's and DeepSeek's are not
    special tokens).
    harmony: the reply is a harmony (gpt-oss) one: free analysis messages, then the constraint is the content
    of its `final` message (edgeserve.text.harmony.answer_frame).
    tokens: texts a "lark" source quotes on their own (`"<tool_call>"`) that, where the tokenizer has one as a
    single special token, mean that token (no text regex matches a special token).
    own_thought: the "lark" source covers the rest of the thought the prompt opened itself (a close tag of
    several tokens that `think` cannot end on): never to be given `think`.
    """

    kind: str
    source: str = ""
    think: tuple[str, str] | None = None
    harmony: bool = False
    tokens: tuple[str, ...] = ()
    own_thought: bool = False

    @staticmethod
    def json_schema(schema: dict | str, think: tuple[str, str] | None = None) -> "GrammarSpec":
        """A spec for output matching a JSON schema (a dict or its JSON text)."""
        text = schema if isinstance(schema, str) else json.dumps(schema)  # key order kept: it is the output order
        return GrammarSpec("json_schema", text, think)

    def lark(self, special_id: Callable[[str], int | None] = lambda text: None) -> str:
        """The whole grammar in llguidance's Lark dialect (`special_id`: the id of a text that is one special
        token of the tokenizer, else None)."""
        if self.kind == "json_schema":
            body = json_rule(json.loads(self.source))
        elif self.kind == "json_object":
            body = json_rule({"type": "object"})
        elif self.kind == "regex":
            body = "/" + llguidance.regex_to_lark(self.source) + "/"
        elif self.kind != "lark":
            raise GrammarError(f"unknown grammar kind {self.kind!r}")
        grammar = self.source if self.kind == "lark" else f"start: {body}\n"
        for text in self.tokens:
            token = special_id(text)
            if token is not None:
                grammar = grammar.replace(json.dumps(text), f"<[{token}]>")
        if self.think is None and not self.harmony:
            return grammar
        prefix = answer_frame() if self.harmony else _think_prefix(self.think, special_id)
        return prefix + grammar.replace("start:", "answer_start:", 1)

    @staticmethod
    def _with_options(schema: Any) -> str:
        if isinstance(schema, dict):
            guidance = schema.get("x-guidance") if isinstance(schema.get("x-guidance"), dict) else {}
            schema = {**schema, "x-guidance": {**_JSON_OPTIONS, **guidance}}
        return json.dumps(schema)


def json_rule(schema: Any) -> str:
    """A Lark `%json` expression for `schema` with the compact whitespace every JSON constraint here uses."""
    return f"%json {GrammarSpec._with_options(schema)}"


def _think_prefix(think: tuple[str, str], special_id: Callable[[str], int | None]) -> str:
    open_, close = think
    ids = special_id(open_) if open_ else None, special_id(close)
    if ids[1] is not None and (not open_ or ids[0] is not None):
        # tags that are single added tokens: the grammar engine sees them as special tokens, which no text
        # regex can match, so the thought is plain text between the two tokens
        head = f"<[{ids[0]}]> " if open_ else ""
        rules = f"thought: {head}THOUGHT <[{ids[1]}]>\nTHOUGHT: /(?s:.*)/\n"
    else:
        # text tags: the thought ends at the first `close` (llguidance's stop=)
        head = f"{json.dumps(open_)} " if open_ else ""
        rules = f"thought: {head}body\nbody[stop={json.dumps(close)}]: /(?s:.*)/\n"
    # an empty `open_` means the prompt opened the reasoning; else it is optional (the model may not think)
    start = "start: thought WS? answer_start\n" if not open_ else "start: thought? WS? answer_start\n"
    return start + rules + "WS: /[ \\t\\r\\n]{1,2}/\n"  # bounded: a model cannot loop on whitespace


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, compiler: "GrammarCompiler") -> None:
        self.matcher = matcher
        self.compiler = compiler

    def accept(self, tokens: list[int]) -> bool:
        """Advance over accepted tokens; False if the grammar refused one (it then allows only end-of-turn)."""
        return self.matcher.consume_tokens(tokens)

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more but end-of-turn."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        """Why the grammar stopped accepting tokens ('' when it did not)."""
        return self.matcher.get_error() if self.matcher.is_error() else ""


class GrammarCompiler:
    """Compiles grammars for one tokenizer, once each (an LRU of template matchers), and starts request states."""

    CACHE_SIZE = 128

    def __init__(self, backend_json: str, vocab_size: int, eos_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self.tokenizer = llguidance.LLTokenizer(backend_json, n_vocab=vocab_size, eos_token=sorted(eos_ids))
        self._cache: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = llguidance.LLExecutor()
        self._specials: dict[str, int] | None = None  # special tokens' texts, built on first need

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int) -> "GrammarCompiler":
        """The compiler of an edgeserve Tokenizer (built once per tokenizer; ~1 s for a 150k vocabulary)."""
        compiler = getattr(tokenizer, "_grammar_compiler", None)
        if compiler is None or compiler.vocab_size != vocab_size:
            compiler = cls(tokenizer.backend.to_str(), vocab_size, sorted(tokenizer.eot_ids))
            tokenizer._grammar_compiler = compiler
        return compiler

    def compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """The template matcher of `spec`, compiled on first use; GrammarError names what is unsupported."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        try:
            lark = spec.lark(self._special_id)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"invalid grammar: {e}") from None
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        problem = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if problem:
            raise GrammarError(_explain(problem))
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(_explain(matcher.get_error()))
        if spec.think is not None:  # the answer after the reasoning must be producible too
            self.compile(replace(spec, think=None))
        problem = self._dead_start(matcher)
        if problem:
            raise GrammarError(f"the grammar accepts no output: {problem}")
        with self._lock:
            self._cache[spec] = matcher
            while len(self._cache) > self.CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    PROBE_STEPS = 16  # forced tokens walked at compile time

    def _dead_start(self, template: llguidance.LLMatcher) -> str:
        """Why no output can start (the grammar engine's error), or '' when one can.

        On a copy: the first mask, then as long as exactly one token is allowed (a token every output begins with)
        that token and the next mask. A schema no finite text satisfies (`{"$ref": "#"}`, a required property that
        refers back to the root, a pattern too large to build) fails here, before any request runs it; a failure
        further in is caught while decoding (the request then ends with an error)."""
        import llguidance.torch as llg_torch  # here, not at import: it loads torch and its compiler
        import numpy as np

        m = template.deep_copy()
        bitmask = llg_torch.allocate_token_bitmask(1, self.vocab_size)
        eos = set(self.eos_ids)
        for _ in range(self.PROBE_STEPS):
            llg_torch.fill_next_token_bitmask(m, bitmask, 0)
            if m.is_error():
                return _first_line(m.get_error())
            bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[: self.vocab_size]
            allowed = [t for t in np.flatnonzero(bits[: self.vocab_size]).tolist() if t not in eos]
            if not allowed:
                return "" if m.is_accepting() or m.is_stopped() else "no token is allowed at the start"
            if len(allowed) > 1:
                return ""
            if not m.consume_token(allowed[0]) or m.is_error():
                return _first_line(m.get_error())
        return ""

    def _special_id(self, text: str) -> int | None:
        token = self.tokenizer.tokenize_str(text, parse_special=True)
        if len(token) == 1 and self.tokenizer.is_special_token(token[0]):
            return token[0]
        # llguidance finds special tokens in text only where they start with "<" at a scan point; markup such as
        # MiniMax M3's "]<]minimax[>[" is looked up among the vocabulary's special tokens instead (once)
        if self._specials is None:
            self._specials = {}
            for i in range(self.tokenizer.vocab_size):
                if self.tokenizer.is_special_token(i):
                    self._specials.setdefault(self.tokenizer.decode_str([i]), i)
        return self._specials.get(text)

    def start(self, spec: GrammarSpec) -> GrammarState:
        """A fresh state of `spec` for one request."""
        return GrammarState(self.compile(spec).deep_copy(), self)

    # below this many rows, one native call per row beats llguidance's thread pool (measured at batch 8: ~12 us
    # a row either way, plus the pool's hand-off, which grows on a busy machine)
    PARALLEL_FROM = 16

    def fill_masks(self, states: list[GrammarState], bitmask: torch.Tensor) -> None:
        """Write each state's allowed-token bitmask into row i of `bitmask` (int32 [len(states), ceil(V/32)])."""
        import llguidance.torch as llg_torch

        if len(states) >= self.PARALLEL_FROM:
            llg_torch.fill_next_token_bitmask_par(self._executor, [(s.matcher, i) for i, s in enumerate(states)],
                                                  bitmask)
            return
        for i, s in enumerate(states):
            llg_torch.fill_next_token_bitmask(s.matcher, bitmask, i)


def _first_line(problem: str) -> str:
    return problem.strip().splitlines()[0] if problem.strip() else "unknown error"


def _explain(problem: str) -> str:
    problem = problem.strip().splitlines()[0] if problem.strip() else "unknown error"
    if "Unimplemented keys" in problem:
        return f"unsupported JSON schema feature: {problem}"
    return f"grammar cannot be compiled: {problem}"


def allowed_mask(states: list[GrammarState], vocab: int) -> torch.Tensor:
    """bool [len(states), vocab]: which tokens each state allows next (computed on the host, in one native call)."""
    import llguidance.torch as llg_torch
    import numpy as np
    import torch

    compiler = states[0].compiler
    bitmask = llg_torch.allocate_token_bitmask(len(states), compiler.vocab_size)
    compiler.fill_masks(states, bitmask)
    # bit j of word w is token 32w + j: little-endian words, so the bytes' bits in little bit order (numpy: no
    # intra-op thread pool for this small op)
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    allowed = torch.from_numpy(bits[:, :vocab].view(np.bool_))
    stuck = ~allowed.any(-1)
    if stuck.any():  # a grammar in an error state allows nothing: let the request end instead of sampling NaNs
        allowed[stuck.nonzero().flatten().unsqueeze(1), torch.tensor(compiler.eos_ids)] = True
    if allowed.shape[1] < vocab:  # logits wider than the grammar's vocabulary: padding tokens are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    return allowed
