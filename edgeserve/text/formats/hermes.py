"""Hermes (NousResearch Hermes 2 Pro / 3, Qwen2.5 / Qwen3, and the fallback for templates that write no calls of
their own): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call. It is also the format
of edgeserve's own tools prompt (edgeserve.text.tool_calls.TOOLS_SYSTEM_PROMPT) for templates that know no tools.

A block whose closing tag is missing (the reply ended first) is still a call when its JSON is complete.
"""

from __future__ import annotations

import re

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall
from edgeserve.text.formats.cut_call import tail_cut
from edgeserve.text.formats.json_calls import calls_from_json, json_values

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


# a call cut short: `<tool_call>\n{"name": "NAME", "arguments": {...` so far
CUT = tail_cut(r"<tool_call>\s*\{\s*\"name\"\s*:\s*\"(?P<name>[^\"]+)\"\s*,?\s*(?:\"arguments\"\s*:\s*(?P<args>.*))?")

FORMATS = (ChatFormat("hermes", detect=lambda source: OPEN in source, call_markers=(OPEN,), parse=parse,
                      priority=900, cut=CUT),)
