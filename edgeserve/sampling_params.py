"""SamplingParams: how one request picks its tokens and when it stops."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from edgeserve.text.grammar import GrammarSpec


@dataclass
class SamplingParams:
    """Per-request sampling settings; invalid values raise ValueError naming the field."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0  # 1.0 = off; over prompt and output tokens (HF/vLLM)
    presence_penalty: float = 0.0  # over output tokens (OpenAI)
    frequency_penalty: float = 0.0  # over output tokens (OpenAI)
    penalty_last_n: int = -1  # the penalties look at the last n tokens only (-1 = all; 0 = penalties off; Ollama)
    typical_p: float = 1.0  # locally typical sampling (1.0 = off; Ollama / llama.cpp)
    logprobs: int | None = None  # report the chosen token's logprob and this many top alternatives
    stop: list[str] = field(default_factory=list)  # stop strings: the text ends before the first match
    stop_token_ids: list[int] = field(default_factory=list)  # extra ids that end the request, like EOS
    ignore_eos: bool = False  # keep going past end-of-turn tokens (benchmarks)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (-100 to 100)
    speculative: bool = True  # use the engine's speculative decoding, if it has one (False: opt out)
    # constrained decoding (edgeserve.text.grammar): every token is masked to what the grammar allows, and
    # end-of-turn only where it may end. `json_schema` (a dict or JSON text) and `json_object` are shorthands
    # for `grammar`; constrained requests never speculate (their tokens are drawn one at a time).
    grammar: GrammarSpec | None = None
    json_schema: dict[str, Any] | str | None = None
    json_object: bool = False
    # a thinking budget (edgeserve.engine.sched.thinking_budget.ThinkingBudget): after that many reasoning tokens the
    # model's closing tag is forced and the answer follows
    thinking: Any = None

    # the largest number of top alternatives `logprobs` may ask for
    MAX_LOGPROBS = 20
    MAX_STOP = 16  # stop strings per request
    MAX_LOGIT_BIAS = 1024  # entries of logit_bias
    MAX_TOP_K = 1_000_000  # larger than any vocabulary: the same as 0 (off)
    MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1  # int64, as OpenAI; n > 1 adds the choice index

    @property
    def penalized(self) -> bool:
        """Whether a penalty reads this request's earlier tokens when sampling."""
        return self.penalty_last_n != 0 and (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0)

    @property
    def filtered(self) -> bool:
        """Whether top-k, top-p or min-p narrows the tokens a sampled row is drawn from."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def __post_init__(self) -> None:
        self._check_constraints()
        self._check_sampling()
        self._check_stops()

    def _check_constraints(self) -> None:
        """Grammar, JSON schema / object and thinking budget: at most one output constraint, of the right types."""
        if sum(x is not None and x is not False for x in (self.grammar, self.json_schema, self.json_object)) > 1:
            raise ValueError("grammar, json_schema and json_object are exclusive: give at most one")
        if self.json_schema is not None:
            if not isinstance(self.json_schema, (dict, str)):
                raise ValueError("json_schema must be a JSON schema (an object or its JSON text)")
            self.grammar = GrammarSpec.json_schema(self.json_schema)
        elif self.json_object:
            self.grammar = GrammarSpec("json_object")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise ValueError("grammar must be an edgeserve.text.grammar.GrammarSpec")
        if self.thinking is not None:
            from edgeserve.engine.sched.thinking_budget import ThinkingBudget

            if not isinstance(self.thinking, ThinkingBudget):
                raise ValueError("thinking must be an edgeserve.engine.sched.thinking_budget.ThinkingBudget")

    def _check_sampling(self) -> None:
        """Every number that shapes the distribution, the length and the logprobs, inside its range."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be between 0 and 100, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= self.MAX_TOP_K:
            raise ValueError(f"top_k must be an integer from 0 (off) to {self.MAX_TOP_K}, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int)
                                      or not self.MIN_SEED <= self.seed <= self.MAX_SEED + 64):
            raise ValueError(f"seed must be an integer from {self.MIN_SEED} to {self.MAX_SEED}, got {self.seed!r}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be a positive number (1 = off), got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be between -2 and 2, got {getattr(self, name)!r}")
        if not isinstance(self.penalty_last_n, int) or isinstance(self.penalty_last_n, bool) \
                or self.penalty_last_n < -1:
            raise ValueError(f"penalty_last_n must be an integer from -1 (all tokens), got {self.penalty_last_n!r}")
        if not 0.0 < self.typical_p <= 1.0:
            raise ValueError(f"typical_p must be in (0, 1], got {self.typical_p!r}")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
            or not 0 <= self.logprobs <= self.MAX_LOGPROBS
        ):
            raise ValueError(f"logprobs must be an integer between 0 and {self.MAX_LOGPROBS}, got {self.logprobs!r}")

    def _check_stops(self) -> None:
        """Stop strings (one string becomes a list), stop token ids and logit biases, bounded in number."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(x, str) and x for x in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > self.MAX_STOP:
            raise ValueError(f"stop may hold at most {self.MAX_STOP} strings, got {len(self.stop)}")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in self.stop_token_ids
        ):
            raise ValueError("stop_token_ids must be a list of non-negative integers")
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > self.MAX_LOGIT_BIAS or not all(
            isinstance(k, int) and not isinstance(k, bool) and k >= 0
            and isinstance(v, (int, float)) and not isinstance(v, bool) and -100.0 <= v <= 100.0
            for k, v in self.logit_bias.items()
        ):
            raise ValueError(f"logit_bias must map at most {self.MAX_LOGIT_BIAS} non-negative token ids to numbers "
                             "from -100 to 100")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
