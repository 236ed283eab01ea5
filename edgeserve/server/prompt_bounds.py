"""Cheap bounds on a request's prompt size, checked before its chat template is rendered or its text tokenized.

A body of a few MB (100k messages, one message of 780k words) would take seconds to render and tokenize only to
be refused as longer than the context. Two lower bounds on its token count refuse it first, in microseconds:
every message takes at least one token, and no token covers more characters than the longest one in the
vocabulary (`CHARS_SLACK` times over, since a tokenizer's normalizer may compose characters before it splits).
"""

from __future__ import annotations

from typing import Any

from edgeserve.server.errors import APIError

CHARS_SLACK = 4
COUNT_CHUNK_CHARS = 32768  # a long text is first counted in pieces of this many characters ...
COUNT_CHUNK_SLACK = 8  # ... each counted this many tokens short (a cut can split or merge a few tokens)


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token of `tokenizer` stands for (its longest vocabulary entry; computed once)."""
    cached = getattr(tokenizer, "_max_token_chars", None)
    if cached is None:
        vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
        cached = max(map(len, vocab), default=1)
        tokenizer._max_token_chars = cached
    return cached


def _text_chars(messages: list[dict] | None, prompts: list[str | list[int]]) -> int:
    """Characters of the longest prompt: all messages' contents together, or one completion prompt."""
    chars = max((len(p) for p in prompts if isinstance(p, str)), default=0)
    return max(chars, sum(len(m["content"]) for m in messages or () if isinstance(m.get("content"), str)))


def surely_too_long(tokenizer: Any, text: str, context: int) -> int:
    """0 when `text` may fit in `context` tokens; else a lower bound on its token count (> context).

    A text longer than a context's worth at 4 characters a token is counted piece by piece and stops as soon as the
    pieces pass the context, so a refused text costs about one context of tokenizing, whatever its size."""
    if len(text) <= context * 4:
        return 0
    count = 0
    for start in range(0, len(text), COUNT_CHUNK_CHARS):
        piece = text[start:start + COUNT_CHUNK_CHARS]
        count += max(0, len(tokenizer.backend.encode(piece, add_special_tokens=False).ids) - COUNT_CHUNK_SLACK)
        if count > context:
            return count
    return 0


def too_long_error(count: int, context: int, param: str) -> APIError:
    """The 400 for a prompt of at least `count` tokens."""
    return APIError(400, f"the prompt has more than {count} tokens but the context is {context} tokens",
                    "invalid_request_error", param, "context_length_exceeded")


def check_prompt_size(messages: list[dict] | None, prompts: list[str | list[int]], context: int, token_chars: int,
                      param: str) -> None:
    """400 `context_length_exceeded` naming `param` when the prompt surely has more than `context` tokens."""
    def refuse(what: str) -> APIError:
        return APIError(400, f"{what}, more than the context of {context} tokens can hold",
                        "invalid_request_error", param, "context_length_exceeded")

    if messages is not None and len(messages) > context:
        raise refuse(f"the request has {len(messages)} messages (each takes at least one token)")
    longest = max((len(p) for p in prompts if not isinstance(p, str)), default=0)
    if longest > context:
        raise refuse(f"a prompt has {longest} token ids")
    chars = _text_chars(messages, prompts)
    if chars > context * token_chars * CHARS_SLACK:
        raise refuse(f"the prompt holds {chars} characters (at least {chars // (token_chars * CHARS_SLACK)} tokens: "
                     f"no token of this model covers more than {token_chars} characters)")
