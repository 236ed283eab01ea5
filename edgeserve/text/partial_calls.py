"""Tool calls out of a forced reply that was cut short (max_tokens), as OpenAI returns them: the call with the
arguments generated so far.

A forced reply is JSON: the named function's arguments, or under tool_choice "required" an array of
{"name", "arguments"} objects (edgeserve.text.tool_calls.forced_schema). Cut, it is a prefix of that JSON.
"""

from __future__ import annotations

import json
import re

from edgeserve.text.tool_calls import ToolCall

_CUT_CALL = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*(?:,\s*"arguments"\s*:\s*)?')


def cut_forced_calls(text: str, choice: str | None) -> list[ToolCall]:
    """The calls of a forced reply cut short: the named function `choice` with the partial arguments; under
    "required" (choice None) every complete call, then the cut one when its name is complete (its arguments as
    far as they got). Nothing when not even a name was generated."""
    text = text.strip()
    if choice is not None:
        return [ToolCall(choice, text)] if text else []
    if not text.startswith("["):
        return []
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    pos = 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return calls
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            cut = _CUT_CALL.match(text, pos)
            if cut is not None:
                calls.append(ToolCall(json.loads(cut.group(1)), text[cut.end():]))
            return calls
        if isinstance(value, dict) and isinstance(value.get("name"), str):
            calls.append(ToolCall(value["name"], json.dumps(value.get("arguments", {}), ensure_ascii=False)))
