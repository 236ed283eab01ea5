"""OpenBMB MiniCPM5: XML calls, `<function name="NAME"><param name="KEY">VALUE</param>...</function>`.

A VALUE is text typed by the parameter's schema (edgeserve.text.xml_tool_calls.typed_value: numbers, booleans,
objects and arrays as such; Python literals, as the template writes them, too); `<![CDATA[...]]>` carries a
value with markup in it. Reasoning is `<think>...</think>` (the prompt opens it when `enable_thinking` is
true). Detected by `<function name="` with `<param name="`.
"""

from __future__ import annotations

import json
from typing import Any

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall
from edgeserve.text.formats.markup import (Read, call_rules, free_text, lit, param_sequence, parameters, scan,
                                           skip_space)
from edgeserve.text.xml_tool_calls import resolve_ref, typed_value

FUNCTION_OPEN, FUNCTION_CLOSE = '<function name="', "</function>"
PARAM_OPEN, PARAM_CLOSE = '<param name="', "</param>"
CDATA = ("<![CDATA[", "]]>")
THINK = ("<think>", "</think>")


def _read_function(text: str, pos: int, ctx: CallContext) -> Read | None:
    """`NAME">` + params + `</function>` after `<function name="`."""
    head = text.find('">', pos)
    name = text[pos:head] if head >= 0 else ""
    if name not in ctx.known:
        return None
    schema = ctx.schemas.get(name) or {}
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    args: dict[str, Any] = {}
    at = head + 2
    while True:
        at = skip_space(text, at)
        if text.startswith(FUNCTION_CLOSE, at):
            return Read([ToolCall(name, json.dumps(args, ensure_ascii=False))], "", at + len(FUNCTION_CLOSE))
        param = _read_param(text, at) if text.startswith(PARAM_OPEN, at) else None
        if param is None:
            return None
        key, value, cdata, at = param
        args[key] = value if cdata else typed_value(value, resolve_ref(props.get(key), schema))


def _read_param(text: str, at: int) -> tuple[str, str, bool, int] | None:
    """(key, value text, whether it was CDATA, position after `</param>`) of the param at `at`, or None."""
    at += len(PARAM_OPEN)
    head = text.find('">', at)
    if head < 0:
        return None
    key, at = text[at:head], head + 2
    if text.startswith(CDATA[0], at):
        end = text.find(CDATA[1], at)
        close = skip_space(text, end + len(CDATA[1])) if end >= 0 else -1
        if close < 0 or not text.startswith(PARAM_CLOSE, close):
            return None
        return key, text[at + len(CDATA[0]):end], True, close + len(PARAM_CLOSE)
    end = text.find(PARAM_CLOSE, at)
    return (key, text[at:end], False, end + len(PARAM_CLOSE)) if end >= 0 else None


def parse(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a reply from its first `<function name="` on."""
    return scan(text, {FUNCTION_OPEN: _read_function}, ctx)


def forced(tools: list[dict], choice: str | None, parallel: bool) -> Any:
    """The grammar of `<function name="NAME">...</function>` calls: each declared parameter in schema order
    (required ones always), strings as text up to `</param>`, other values as JSON."""
    from edgeserve.text.grammar import GrammarSpec, json_rule

    extra: list[str] = []

    def call(name: str, args_rule: str) -> str:
        params = next(parameters(t) for t in tools if t["function"]["name"] == name)
        seq = param_sequence(params, lambda key: lit(PARAM_OPEN + key + '">'), PARAM_CLOSE, "", json_rule, extra)
        return f"{lit(FUNCTION_OPEN + name + chr(34) + '>')} {seq} {lit(FUNCTION_CLOSE)}"

    start = 'start: call ("\\n" call)*\n' if parallel and choice is None else "start: call\n"
    rules = call_rules(tools, choice, call, json_rule)
    return GrammarSpec("lark", start + rules + "".join(extra) + free_text(PARAM_CLOSE))


FORMATS = (
    ChatFormat("minicpm5", lambda s: FUNCTION_OPEN in s and PARAM_OPEN in s, call_markers=(FUNCTION_OPEN,),
               parse=parse, reasoning=THINK, forced=forced, priority=20),
)
