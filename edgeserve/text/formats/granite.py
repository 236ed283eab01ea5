"""IBM Granite 3.3: calls as `<|tool_call|>` then a JSON list of `{"name": ..., "arguments": {...}}`; with its
template's `thinking` switch on, the model thinks in `<think>...</think>` and answers in
`<response>...</response>` (the wrapper is dropped from the content).

Granite 4.0 / 4.1 write hermes `<tool_call>` blocks (the hermes format). Detected by `<|tool_call|>`.
"""

from __future__ import annotations

from typing import Any

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall
from edgeserve.text.formats.markup import (call_rules, json_list_reader, list_grammar, lit, object_call, scan,
                                           wrapper_reader)

TOOL_CALL = "<|tool_call|>"
RESPONSE = ("<response>", "</response>")
THINK = ("<think>", "</think>")


_READERS = {TOOL_CALL: json_list_reader(), RESPONSE[0]: wrapper_reader(RESPONSE[1])}


def parse(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a reply from its first `<|tool_call|>` or `<response>` on."""
    return scan(text, _READERS, ctx)


def forced(tools: list[dict], choice: str | None, parallel: bool) -> Any:
    """The grammar of a `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]` reply."""
    from edgeserve.text.grammar import GrammarSpec, json_rule

    rules = call_rules(tools, choice, object_call, json_rule)
    return GrammarSpec("lark", list_grammar(lit(TOOL_CALL), parallel and choice is None, rules), tokens=(TOOL_CALL,))


FORMATS = (
    ChatFormat("granite", lambda s: TOOL_CALL in s, call_markers=(TOOL_CALL, RESPONSE[0]), parse=parse, reasoning=THINK,
               forced=forced, thinking_switches=("thinking",), priority=20, wraps_answer=True),
)
