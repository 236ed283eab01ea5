"""Benchmark workloads: prompts of known token length and seeded arrival schedules."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

WORKLOADS = ("fixed", "chat", "copy")

# Plain English words that are one token each (with their leading space) in common BPE vocabularies; used
# to build prompt text when no tokenizer is at hand (then a prompt is only about N tokens).
_WORDS = ("the of and to in is it that was for on are as with his they at be this have from or one had by "
          "word but not what all were we when your can said there use an each which she do how their if "
          "will up other about out many then them these so some her would make like him into time has look "
          "two more write go see number no way could people my than first water been call who its now find "
          "long down day did get come made may part over new sound take only little work know place year "
          "live me back give most very after thing our just name good sentence man think say great where "
          "help through much before line right too mean old any same tell boy follow came want show also "
          "around form three small set put end does another well large must big even such because turn here "
          "why ask went men read need land different home us move try kind hand picture again change off "
          "play spell air away animal house point page letter mother answer found study still learn should "
          "world high every near add food between own below country plant last school father keep tree never "
          "start city earth eye light thought head under story saw left few while along might close something "
          "seem next hard open example begin life always those both paper together got group often run").split()


class Encoder(Protocol):
    """What a workload needs from a tokenizer (edgeserve.loaders.tokenizer.Tokenizer has it)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


@dataclass
class RequestSpec:
    """One benchmark request: a prompt (token ids or text), how many tokens it is, and how many to generate."""

    prompt: list[int] | str
    prompt_tokens: int  # exact for token ids; for text, the count under the tokenizer (or the word count)
    max_tokens: int
    shared_prefix_tokens: int = 0


@dataclass
class Workload:
    """A list of requests and how their prompts were built ("token ids" or "text")."""

    name: str
    requests: list[RequestSpec]
    prompt_format: str
    notes: dict = field(default_factory=dict)


class TokenSource:
    """Makes seeded filler prompts of exactly N tokens (as ids) or text of about N tokens.

    With a tokenizer, ids come from encoding seeded random English sentences; text is those ids decoded (and
    its real token count is re-measured). Without one, text is N one-token words and ids are not available.
    """

    def __init__(self, tokenizer: Encoder | None = None, as_ids: bool = True) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids and tokenizer is not None

    @property
    def prompt_format(self) -> str:
        """'token ids' (exact lengths) or 'text' (lengths about N)."""
        return "token ids" if self.as_ids else "text"

    def _words(self, n: int, rng: np.random.Generator) -> list[str]:
        idx = rng.integers(0, len(_WORDS), size=n)
        return [_WORDS[i] for i in idx]

    def ids(self, n: int, rng: np.random.Generator) -> list[int]:
        """Exactly `n` token ids of seeded English-like text (needs a tokenizer)."""
        if self.tokenizer is None:
            raise ValueError("token-id prompts need a tokenizer")
        out: list[int] = []
        while len(out) < n:
            words = self._words(max(16, n - len(out) + 8), rng)
            text = " " + " ".join(words) + "."
            out.extend(self.tokenizer.encode(text, add_special_tokens=False))
        return out[:n]

    def count(self, text: str) -> int:
        """Tokens in `text` under the tokenizer, or its word count without one."""
        if self.tokenizer is None:
            return len(text.split())
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, n: int, rng: np.random.Generator) -> list[int] | str:
        """A prompt of `n` tokens: ids, or text that tokenizes to about `n`."""
        if self.as_ids:
            return self.ids(n, rng)
        if self.tokenizer is not None:
            return self.tokenizer.decode(self.ids(n, rng))
        return " ".join(self._words(n, rng))

    def join(self, a: list[int] | str, b: list[int] | str) -> list[int] | str:
        """Concatenate two prompt pieces of the same kind."""
        if isinstance(a, str):
            return a + (" " if a and not a.endswith(" ") and not str(b).startswith(" ") else "") + str(b)
        return list(a) + list(b)

    def length(self, prompt: list[int] | str) -> int:
        """Token count of a built prompt."""
        return len(prompt) if isinstance(prompt, list) else self.count(prompt)


def fixed_workload(source: TokenSource, num_requests: int, prompt_tokens: int, max_tokens: int, seed: int = 0,
                   shared_prefix_tokens: int = 0) -> Workload:
    """`num_requests` requests of `prompt_tokens` distinct tokens (after a shared prefix of
    `shared_prefix_tokens`, the same for every request) and `max_tokens` output tokens each."""
    if prompt_tokens < 1 or max_tokens < 1 or num_requests < 1 or shared_prefix_tokens < 0:
        raise ValueError("prompt tokens, max tokens and the request count must be positive")
    rng = np.random.default_rng(seed)
    prefix = source.prompt(shared_prefix_tokens, np.random.default_rng([seed, 1])) if shared_prefix_tokens else None
    reqs = []
    for _ in range(num_requests):
        suffix = source.prompt(prompt_tokens, rng)
        prompt = source.join(prefix, suffix) if prefix is not None else suffix
        reqs.append(RequestSpec(prompt, source.length(prompt), max_tokens, shared_prefix_tokens))
    name = "fixed" if not shared_prefix_tokens else "shared-prefix"
    return Workload(name, reqs, source.prompt_format,
                    {"prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
                     "shared_prefix_tokens": shared_prefix_tokens})


def chat_workload(source: TokenSource, num_requests: int, seed: int = 0, mean_prompt_tokens: int = 256,
                  mean_output_tokens: int = 128, shared_prefix_tokens: int = 0) -> Workload:
    """A seeded mix of chat-like lengths: prompt and output lengths drawn log-normally around the means
    (prompts 8..8x the mean, outputs 4..4x the mean), like a chat service sees."""
    rng = np.random.default_rng(seed)
    sigma = 0.8
    mu_p = np.log(mean_prompt_tokens) - sigma ** 2 / 2
    mu_o = np.log(mean_output_tokens) - sigma ** 2 / 2
    p_lens = np.clip(rng.lognormal(mu_p, sigma, num_requests), 8, 8 * mean_prompt_tokens).astype(int)
    o_lens = np.clip(rng.lognormal(mu_o, sigma, num_requests), 4, 4 * mean_output_tokens).astype(int)
    prefix = source.prompt(shared_prefix_tokens, np.random.default_rng([seed, 1])) if shared_prefix_tokens else None
    reqs = []
    for p, o in zip(p_lens.tolist(), o_lens.tolist()):
        suffix = source.prompt(p, rng)
        prompt = source.join(prefix, suffix) if prefix is not None else suffix
        reqs.append(RequestSpec(prompt, source.length(prompt), o, shared_prefix_tokens))
    return Workload("chat", reqs, source.prompt_format,
                    {"mean_prompt_tokens": mean_prompt_tokens, "mean_output_tokens": mean_output_tokens,
                     "shared_prefix_tokens": shared_prefix_tokens})


COPY_INSTRUCTION = "Copy the text below exactly, then copy it again.\n\nText:\n"


def copy_workload(source: TokenSource, num_requests: int, prompt_tokens: int, max_tokens: int,
                  seed: int = 0) -> Workload:
    """Requests whose answer repeats text from the prompt (where speculative decoding helps): an instruction,
    a passage of about `prompt_tokens` tokens, the passage again, then the passage's first words so a
    completion continues copying."""
    rng = np.random.default_rng(seed)
    reqs = []
    for _ in range(num_requests):
        passage_len = max(8, (prompt_tokens - 16) // 2)
        passage = source.prompt(passage_len, rng)
        head = passage[:4] if isinstance(passage, list) else " ".join(passage.split()[:4])
        if isinstance(passage, list):
            assert source.tokenizer is not None
            instr = source.tokenizer.encode(COPY_INSTRUCTION, add_special_tokens=False)
            sep = source.tokenizer.encode("\n\nCopy:\n", add_special_tokens=False)
            prompt: list[int] | str = instr + passage + sep + passage + sep + head
        else:
            prompt = f"{COPY_INSTRUCTION}{passage}\n\nCopy:\n{passage}\n\nCopy:\n{head}"
        reqs.append(RequestSpec(prompt, source.length(prompt), max_tokens))
    return Workload("copy", reqs, source.prompt_format, {"passage_tokens": prompt_tokens, "max_tokens": max_tokens})


def poisson_arrivals(num_requests: int, rate: float, seed: int = 0) -> np.ndarray:
    """Send times (seconds from the start) of a Poisson process of `rate` requests/s: cumulative sums of
    seeded exponential gaps, the first request at 0. rate = inf sends everything at once."""
    if rate <= 0:
        raise ValueError("request rate must be positive")
    if np.isinf(rate):
        return np.zeros(num_requests)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num_requests)
    gaps[0] = 0.0
    return np.cumsum(gaps)
