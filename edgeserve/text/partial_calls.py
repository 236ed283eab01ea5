"""Tool calls out of a forced reply that was cut short (max_tokens), as OpenAI returns them: the call with the
arguments generated so far.

The generic forced reply is JSON: the named function's arguments, or under tool_choice "required" an array of
{"name", "arguments"} objects (edgeserve.text.tool_calls.forced_schema). Cut, it is a prefix of that JSON
(`cut_forced_calls`). Formats whose calls are such objects behind their own markup (hermes, mistral, llama3) read
their cut replies with `cut_call_objects`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from edgeserve.text.formats.base import CallContext, ToolCall

_CUT_CALL = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*(,\s*"(?:arguments|parameters)"\s*:\s*)?')
_DECODER = json.JSONDecoder()


def cut_forced_calls(text: str, choice: str | None) -> list[ToolCall]:
    """The calls of a generic forced reply cut short: the named function `choice` with the partial arguments;
    under "required" (choice None) every complete call, then the cut one when its name is complete (its arguments
    as far as they got). Nothing when not even a name was generated."""
    text = text.strip()
    if choice is not None:
        return [ToolCall(choice, text)] if text else []
    if not text.startswith("["):
        return []
    return cut_call_objects(text, 1)


def cut_call_objects(text: str, pos: int = 0, ctx: CallContext | None = None) -> list[ToolCall]:
    """The calls of a run of `{"name": ..., "arguments" (or "parameters"): {...}}` objects from `pos` (separated
    by whitespace, commas or semicolons; a `]` or anything else ends the run) that was cut short: every complete
    one (its "id" the call's id), then the cut one when its name is complete. `ctx`: only its functions are calls
    (None: any name)."""
    calls: list[ToolCall] = []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,;":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            value, pos = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            cut = cut_call_object(text, pos)
            calls += [cut] if cut is not None else []
            break
        call = _whole_call(value)
        if call is None:
            break
        calls.append(call)
    return [c for c in calls if ctx is None or c.name in ctx.known]


def cut_call_object(text: str, pos: int) -> ToolCall | None:
    """The call of the cut-short `{"name": NAME, "arguments": ...` at `pos`: its arguments as far as they got
    ('' before they start; whole when only what follows them was cut, as Mistral's "id"), or None when the name
    is not complete."""
    cut = _CUT_CALL.match(text, pos)
    if cut is None:
        return None
    args = text[cut.end():] if cut.group(2) else ""
    try:
        whole, _ = _DECODER.raw_decode(args)
        args = json.dumps(whole, ensure_ascii=False)
    except json.JSONDecodeError:
        pass
    return ToolCall(json.loads(cut.group(1)), args)


def _whole_call(value: Any) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = next((value[k] for k in ("arguments", "parameters") if k in value), {})
    call_id = value.get("id")
    return ToolCall(value["name"], json.dumps(args, ensure_ascii=False), call_id if isinstance(call_id, str) else "")
