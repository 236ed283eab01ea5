"""Hermes (NousResearch Hermes 2 Pro / 3, Qwen2.5 / Qwen3, and the fallback for templates that write no calls of
their own): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call. It is also the format
of edgeserve's own tools prompt (edgeserve.text.tool_calls.TOOLS_SYSTEM_PROMPT) for templates that know no tools.

A block whose closing tag is missing (the reply ended first) is still a call when its JSON is complete. Forced
calls are blocks in this syntax, newline-separated when parallel.
"""

from __future__ import annotations

import re

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall

from edgeserve.text.formats.json_calls import calls_from_json, json_values
from edgeserve.text.formats.markup import call_rules, calls_rule, lit, object_call
from edgeserve.text.grammar import GrammarSpec, json_rule
from edgeserve.text.partial_calls import cut_call_objects

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|$)", re.S)


def parse(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls): every block whose JSON is wholly calls of offered functions; the rest stays content."""
    calls: list[ToolCall] = []
    kept, last = [], 0
    for m in _BLOCK.finditer(text):
        values, end = json_values(m.group(1))
        found = calls_from_json(values, ctx) if m.group(1)[end:].strip() == "" else None
        if found:
            calls += found
            kept.append(text[last:m.start()])
            last = m.end()
    content = "".join(kept) + text[last:]
    return (content.strip(), calls) if calls else (text, [])


def forced(tools: list[dict], choice: str | None, parallel: bool) -> GrammarSpec:
    """The grammar of a reply that is `<tool_call>` blocks of `{"name": ..., "arguments": {...}}` (one unless
    `parallel`), arguments by each tool's schema; the newlines around the JSON as the templates write them
    (optional: a model may leave them out)."""
    start = f"start: {calls_rule('block', parallel and choice is None, chr(10))}\n"
    block = f'block: {lit(OPEN)} "\\n"? call "\\n"? {lit(CLOSE)}\n'
    return GrammarSpec("lark", start + block + call_rules(tools, choice, object_call, json_rule), tokens=(OPEN, CLOSE))


def cut(text: str, ctx: CallContext) -> list[ToolCall]:
    """The calls of a forced reply cut short: the call of each block, the last one as far as it got."""
    return [c for m in re.finditer(re.escape(OPEN), text) for c in cut_call_objects(text, m.end(), ctx)[:1]]


FORMATS = (ChatFormat("hermes", detect=lambda source: OPEN in source, call_markers=(OPEN,), parse=parse,
                      forced=forced, cut=cut, priority=900),)
