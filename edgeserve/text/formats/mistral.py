"""Mistral's JSON-array calls (Mistral 7B v0.3, Mistral Nemo, Mixtral): `[TOOL_CALLS][{"name": ..., "arguments":
{...}}, ...]`, every call of the reply in one array after one tag. (Mistral Small 3.2, Devstral, Magistral and
Ministral 3 write `[TOOL_CALLS]name[ARGS]{...}` instead: a format of its own, detected before this one.)"""

from __future__ import annotations

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall
from edgeserve.text.formats.json_calls import calls_from_json, json_values

TAG = "[TOOL_CALLS]"


def parse(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls): the JSON after the tag when it is wholly calls of offered functions; else all content."""
    at = text.find(TAG)
    if at < 0:
        return text, []
    values, end = json_values(text, at + len(TAG))
    calls = calls_from_json(values, ctx)
    if not calls:
        return text, []
    return (text[:at] + text[end:]).strip(), calls


FORMATS = (ChatFormat("mistral", detect=lambda source: TAG in source, call_markers=(TAG,), parse=parse,
                      priority=800),)
