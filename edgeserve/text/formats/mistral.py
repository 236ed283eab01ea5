"""Mistral's JSON-array calls (Mistral 7B v0.3, Mistral Nemo, Mixtral): `[TOOL_CALLS][{"name": ..., "arguments":
{...}}, ...]`, every call of the reply in one array after one tag. (Mistral Small 3.2, Devstral, Magistral and
Ministral 3 write `[TOOL_CALLS]name[ARGS]{...}` instead: a format of its own, detected before this one.)

Forced calls are that array with each call's id, 9 letters and digits as Nemo's template requires them (llama.cpp's
grammar for Nemo has them too)."""

from __future__ import annotations

import json

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall
from edgeserve.text.formats.json_calls import calls_from_json, json_values
from edgeserve.text.formats.markup import call_rules, calls_rule, lit
from edgeserve.text.grammar import GrammarSpec, json_rule
from edgeserve.text.partial_calls import cut_call_objects

TAG = "[TOOL_CALLS]"
_ID_KEY, _ID_END = ', "id": "', '"}'


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


def forced(tools: list[dict], choice: str | None, parallel: bool) -> GrammarSpec:
    """The grammar of a reply that is `[TOOL_CALLS]` and a JSON array of `{"name", "arguments", "id"}` calls (one
    unless `parallel`), arguments by each tool's schema."""
    def call(name: str, args: str) -> str:
        head = '{"name": ' + json.dumps(name) + ', "arguments": '
        return f"{lit(head)} {args} {lit(_ID_KEY)} CALL_ID {lit(_ID_END)}"

    start = f'start: {lit(TAG)} "[" {calls_rule("call", parallel and choice is None, ", ")} "]"\n'
    return GrammarSpec("lark", start + call_rules(tools, choice, call, json_rule) + "CALL_ID: /[a-zA-Z0-9]{9}/\n",
                       tokens=(TAG,))


def cut(text: str, ctx: CallContext) -> list[ToolCall]:
    """The calls of a forced reply cut short: the array's complete calls, then the cut one as far as it got."""
    at = text.find(TAG)
    start = text.find("[", at + len(TAG)) if at >= 0 else -1
    return cut_call_objects(text, start + 1, ctx) if start >= 0 and not text[at + len(TAG):start].strip() else []


FORMATS = (ChatFormat("mistral", detect=lambda source: TAG in source, call_markers=(TAG,), parse=parse,
                      forced=forced, cut=cut, priority=800),)
