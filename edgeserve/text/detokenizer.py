"""Incremental detokenization that only emits text once it is valid and stable."""

from __future__ import annotations

from collections.abc import Callable, Collection

# How many already-emitted tokens are re-decoded for context (BPE merges and byte runs span a few tokens).
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Feed token ids one step at a time; get back the new text that is safe to show."""

    def __init__(self, decode: Callable[[list[int]], str], prompt_ids: list[int] | None = None,
                 hold_ids: Collection[int] = frozenset()):
        """`prompt_ids` give context only (their text is never emitted, so they should end on complete text).
        `hold_ids`: tokens whose text may still change with the next token (`Tokenizer.byte_fallback_ids`);
        text is held back while the sequence ends with one."""
        self._decode = decode
        self._hold_ids = hold_ids
        self.ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:]) if prompt_ids else []  # the window, not all
        self._prefix = 0  # start of the context window
        self._read = len(self.ids)  # tokens whose text has been emitted

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; return the text they complete (may be '' while a character is still partial)."""
        self.ids.extend(new_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back at the end of generation (an incomplete character decodes as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        unsettled = after.endswith("\ufffd") or (bool(self.ids) and self.ids[-1] in self._hold_ids)
        if (unsettled and not final) or len(after) <= len(before):
            return ""
        self._prefix = max(self._prefix, self._read - _CONTEXT_TOKENS)
        self._read = len(self.ids)
        del self.ids[: self._prefix]  # only the context window is ever decoded again
        self._read -= self._prefix
        self._prefix = 0
        return after[len(before):]
