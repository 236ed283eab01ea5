"""Incremental detokenization that only emits text once it is valid and stable."""

from __future__ import annotations

from typing import Callable

# How many already-emitted tokens are re-decoded for context (BPE merges and byte runs span a few tokens).
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Feed token ids one step at a time; get back the new text that is safe to show."""

    def __init__(self, decode: Callable[[list[int]], str], prompt_ids: list[int] | None = None):
        self._decode = decode
        self.ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:]) if prompt_ids else []
        self._prefix = 0  # start of the context window
        self._read = len(self.ids)  # tokens whose text has been emitted

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; return the text they complete (may be '' while a character is still partial)."""
        self.ids.extend(new_ids)
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        self._prefix = max(self._prefix, self._read - _CONTEXT_TOKENS)
        self._read = len(self.ids)
        return after[len(before):]
