"""ServiceNow Apriel 1.5 / 1.6: calls as `<tool_calls>[{"name": ..., "arguments": {...}}, ...]</tool_calls>`.

Apriel 1.6's prompt opens the reasoning ("Here are my reasoning steps:\\n") and the answer follows
`[BEGIN FINAL RESPONSE]` ("apriel16"). Apriel 1.5 reasons in free text with no opening marker, which a tag pair
cannot describe, so its reasoning stays content ("apriel15"). Detected by `<tool_calls>` with
`[BEGIN FINAL RESPONSE]` (MiniMax M1 also writes `<tool_calls>`), 1.6 by its reasoning opener.
"""

from __future__ import annotations

from typing import Any

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall
from edgeserve.text.formats.markup import call_rules, json_list_reader, list_grammar, lit, object_call, scan

TOOL_CALLS = ("<tool_calls>", "</tool_calls>")
FINAL = "[BEGIN FINAL RESPONSE]"
REASONING = ("Here are my reasoning steps:\n", "\n" + FINAL)

_READERS = {TOOL_CALLS[0]: json_list_reader(TOOL_CALLS[1])}


def parse(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a reply from its first `<tool_calls>` on."""
    return scan(text, _READERS, ctx)


def forced(tools: list[dict], choice: str | None, parallel: bool) -> Any:
    """The grammar of a `<tool_calls>[...]</tool_calls>` reply."""
    from edgeserve.text.grammar import GrammarSpec, json_rule

    rules = call_rules(tools, choice, object_call, json_rule)
    return GrammarSpec("lark", list_grammar(lit(TOOL_CALLS[0]), parallel and choice is None, rules,
                                            lit(TOOL_CALLS[1])), tokens=TOOL_CALLS)


def _apriel(source: str) -> bool:
    return TOOL_CALLS[0] in source and FINAL in source


FORMATS = (
    ChatFormat("apriel16", lambda s: _apriel(s) and REASONING[0].strip() in s, call_markers=(TOOL_CALLS[0],),
               parse=parse, reasoning=REASONING, forced=forced, priority=20, open_tag_is_reasoning=True),
    ChatFormat("apriel15", lambda s: _apriel(s) and REASONING[0].strip() not in s, call_markers=(TOOL_CALLS[0],),
               parse=parse, forced=forced, priority=20),
)
