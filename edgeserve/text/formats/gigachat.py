"""Sber GigaChat 3 and 3.1: one call per reply, a JSON `{"name": ..., "arguments": {...}}` object.

- "gigachat3": the call is a new message of the `function call` role:
  `<|message_sep|>\\n\\nfunction call<|role_sep|>\\n{...}`. Detected by `<|role_sep|>` / `<|message_sep|>`
  without `<|function_call|>`.
- "gigachat31": `<|function_call|>{...}`. Detected by `<|function_call|>` with `<|role_sep|>`.
"""

from __future__ import annotations

from typing import Any

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall
from edgeserve.text.formats.markup import Read, call_rules, json_list_reader, lit, object_call, scan

ROLE_SEP, MESSAGE_SEP, FUNCTION_CALL = "<|role_sep|>", "<|message_sep|>", "<|function_call|>"
CALL_MESSAGE = f"{MESSAGE_SEP}\n\nfunction call{ROLE_SEP}\n"
TOKENS = (ROLE_SEP, MESSAGE_SEP, FUNCTION_CALL)

_ONE = json_list_reader(lists_only=False)


def _single(text: str, pos: int, ctx: CallContext) -> Read | None:
    """One call object (not a list)."""
    read = _ONE(text, pos, ctx)
    return read if read is not None and len(read.calls) == 1 and text[pos:].lstrip().startswith("{") else None


def parse_v3(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a GigaChat 3 reply from its `function call` message on."""
    return scan(text, {CALL_MESSAGE: _single}, ctx)


def parse_v31(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a GigaChat 3.1 reply from its `<|function_call|>` on."""
    return scan(text, {FUNCTION_CALL: _single}, ctx)


def _forced(*head: str) -> Any:
    """The forced grammar of calls after the `head` pieces (each a Lark literal of its own, as the special tokens
    among them must be)."""
    def forced(tools: list[dict], choice: str | None, parallel: bool) -> Any:
        """The grammar of one call (the format has no parallel calls)."""
        from edgeserve.text.grammar import GrammarSpec, json_rule

        start = f"start: {' '.join(map(lit, head))} call\n"
        return GrammarSpec("lark", start + call_rules(tools, choice, object_call, json_rule), tokens=TOKENS)
    return forced


FORMATS = (
    ChatFormat("gigachat3", lambda s: ROLE_SEP in s and MESSAGE_SEP in s and FUNCTION_CALL not in s,
               call_markers=(CALL_MESSAGE,), parse=parse_v3,
               forced=_forced(MESSAGE_SEP, "\n\nfunction call", ROLE_SEP, "\n"), priority=20),
    ChatFormat("gigachat31", lambda s: ROLE_SEP in s and FUNCTION_CALL in s, call_markers=(FUNCTION_CALL,),
               parse=parse_v31, forced=_forced(FUNCTION_CALL), priority=20),
)
