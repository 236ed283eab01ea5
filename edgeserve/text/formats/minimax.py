"""MiniMax's tool calls.

- "minimax_m1": `<tool_calls>` with one `{"name": ..., "arguments": {...}}` JSON object a line, `</tool_calls>`.
  The model (MiniMax-M1, a reasoning model) thinks in `<think>...</think>` although its template never names the
  tag, so the format names it.
- "minimax_m2": `<minimax:tool_call>` around `<invoke name="NAME">` blocks with one
  `<parameter name="KEY">VALUE</parameter>` per argument (values text, typed by the tool's schema). Its prompt
  opens the thought (`<think>\\n`).
- "minimax_m3": every tag prefixed with the namespace token `]<]minimax[>[`; a parameter is an element named after
  it (`<city>Tokyo</city>`), objects expand into one element per key and arrays into `<item>` elements, following
  the tool's schema. Thoughts are `<mm:think>...</mm:think>`; a turn without one starts with a bare `</mm:think>`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall
from edgeserve.text.formats.json_calls import json_call
from edgeserve.text.formats.tag_blocks import (Block, alternatives, call_object_schema, chosen_tools, cut_calls,
                                               invoke_calls, keyed_calls, lit, lits, may_be_string, param_schema,
                                               repeat, string_value, tagged_arg, text_until, typed, typed_params,
                                               value_json_rule)
from edgeserve.text.grammar import GrammarSpec, json_rule
from edgeserve.text.xml_tool_calls import resolve_ref, schema_types

# --- M1 ---------------------------------------------------------------------------------------------------------

M1_OPEN, M1_CLOSE = "<tool_calls>", "</tool_calls>"
M1_BLOCKS = (Block(M1_OPEN, M1_CLOSE),)


def _read_m1(_: str, body: str) -> list[tuple[str, str, str]] | None:
    decoder, pos, calls = json.JSONDecoder(), 0, []
    while body[pos:].strip():
        pos += len(body[pos:]) - len(body[pos:].lstrip())
        try:
            value, pos = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return None
        calls.append(json_call(value))
    return None if not calls or None in calls else calls


def parse_m1(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a MiniMax M1 reply (`<tool_calls>` blocks of JSON lines)."""
    return cut_calls(text, M1_BLOCKS, _read_m1, ctx)


def forced_m1(tools: list[dict], choice: str | None, parallel: bool) -> GrammarSpec:
    """A `<tool_calls>` block of JSON call objects, one a line."""
    source = (f'start: {lit(M1_OPEN + chr(10))} {repeat("call", parallel, choice, chr(10))} {lit(chr(10) + M1_CLOSE)}\n'
              f"call: {json_rule(call_object_schema(tools, choice))}\n")
    return GrammarSpec("lark", source)


# --- M2 ---------------------------------------------------------------------------------------------------------

M2_OPEN, M2_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
M2_TOKENS = (M2_OPEN, M2_CLOSE)
M2_BLOCKS = (Block(M2_OPEN, M2_CLOSE),)
_M2_INVOKE = re.compile(r'\s*<invoke name="([^"]*)">(.*?)</invoke>\s*', re.S)
_M2_PARAM = re.compile(r'\s*<parameter name="([^"]*)">(.*?)</parameter>\s*', re.S)


def _read_m2(body: str, ctx: CallContext) -> list[tuple[str, str, str]] | None:
    return invoke_calls(_M2_INVOKE, body, lambda inv: typed_params(_M2_PARAM, inv.group(2), ctx, inv.group(1)))


def parse_m2(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a MiniMax M2 reply."""
    return cut_calls(text, M2_BLOCKS, lambda _, body: _read_m2(body, ctx), ctx)


def forced_m2(tools: list[dict], choice: str | None, parallel: bool) -> GrammarSpec:
    """A `<minimax:tool_call>` block: string values as text, the others JSON of their schema."""
    chosen = chosen_tools(tools, choice)
    rules = [f"start: {lit(M2_OPEN)} \"\\n\" {repeat('invoke', parallel, choice)} {lit(M2_CLOSE)}\n",
             f"invoke: {alternatives(len(chosen))}\n", text_until("str_value", "</parameter>")]
    rules += keyed_calls(
        chosen, tagged_arg(lambda key: lit(f"<parameter name={json.dumps(key)}>"), "</parameter>"),
        lambda tool, seq: f'{lit("<invoke name=" + json.dumps(tool["function"]["name"]) + ">" + chr(10))} {seq} '
                          f'"</invoke>\\n"')
    return GrammarSpec("lark", "".join(rules), tokens=M2_TOKENS)


# --- M3 ---------------------------------------------------------------------------------------------------------

NS = "]<]minimax[>["  # one special token in M3's vocabulary
M3_TOKENS = (NS, "<tool_call>", "</tool_call>")
M3_THINK = ("<mm:think>", "</mm:think>")
M3_BLOCKS = (Block(NS + "<tool_call>", NS + "</tool_call>"),)
_M3_INVOKE = re.compile(r'\s*' + re.escape(NS) + r'<invoke name="([^"]*)">(.*?)' + re.escape(NS) + r"</invoke>\s*",
                        re.S)
_M3_OPEN = re.compile(r"\s*" + re.escape(NS) + r"<([A-Za-z_][\w.\-]*)>")


def _m3_element(body: str, pos: int, schema: Any, root: dict) -> tuple[str, Any, int] | None:
    """(tag, value, end) of the element at `pos` (its value read by `schema`), None when there is none."""
    m = _M3_OPEN.match(body, pos)
    if m is None:
        return None
    value = _m3_value(body, m.end(), m.group(1), schema, root)
    return None if value is None else (m.group(1), *value)


def _m3_value(body: str, pos: int, tag: str, schema: Any, root: dict) -> tuple[Any, int] | None:
    """(value, end after the closing tag) of an element's content read by `schema`."""
    schema = resolve_ref(schema, root)
    close = f"{NS}</{tag}>"
    if schema is None or may_be_string(schema):
        end = body.find(close, pos)
        return None if end < 0 else (body[pos:end] if schema is not None else typed(body[pos:end], None),
                                     end + len(close))
    for alt in (schema.get("anyOf") or schema.get("oneOf") or []) if isinstance(schema, dict) else []:
        found = _m3_value(body, pos, tag, alt, root)
        if found is not None:
            return found
    types = schema_types(schema)
    props = schema.get("properties") if isinstance(schema, dict) else None
    nested = _M3_OPEN.match(body, pos) is not None  # else the value is written as JSON
    if nested and "object" in types and isinstance(props, dict) and props:
        value = {}
        while (head := _M3_OPEN.match(body, pos)) is not None:
            child = _m3_element(body, pos, props.get(head.group(1)), root)
            if child is None:
                return None
            value[child[0]], pos = child[1], child[2]
        return _m3_close(body, pos, close, value)
    if nested and "array" in types:
        items = []
        while (head := _M3_OPEN.match(body, pos)) is not None and head.group(1) == "item":
            item = _m3_element(body, pos, schema.get("items"), root)
            if item is None:
                return None
            items.append(item[1])
            pos = item[2]
        return _m3_close(body, pos, close, items)
    end = body.find(close, pos)
    if end < 0 or body.find(NS, pos) < end:
        return None
    return typed(body[pos:end].strip(), schema), end + len(close)


def _m3_close(body: str, pos: int, close: str, value: Any) -> tuple[Any, int] | None:
    rest = body[pos:].lstrip()
    return (value, len(body) - len(rest) + len(close)) if rest.startswith(close) else None


def _m3_args(name: str, inner: str, ctx: CallContext) -> dict | None:
    """The arguments of an M3 call to `name`: one element a parameter."""
    root, at, args = ctx.schemas.get(name) or {}, 0, {}
    while inner[at:].strip():
        head = _M3_OPEN.match(inner, at)
        el = _m3_element(inner, at, param_schema(ctx, name, head.group(1)), root) if head else None
        if el is None:
            return None
        args[el[0]], at = el[1], el[2]
    return args


def _read_m3(body: str, ctx: CallContext) -> list[tuple[str, str, str]] | None:
    return invoke_calls(_M3_INVOKE, body, lambda inv: _m3_args(inv.group(1), inv.group(2), ctx))


def parse_m3(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a MiniMax M3 reply."""
    return cut_calls(text, M3_BLOCKS, lambda _, body: _read_m3(body, ctx), ctx)


def forced_m3(tools: list[dict], choice: str | None, parallel: bool) -> GrammarSpec:
    """An M3 call block: each parameter an element; strings as text, other values as JSON of their schema (objects
    and arrays too: the parser reads a JSON value where it finds no child elements)."""
    chosen = chosen_tools(tools, choice)
    n = lit(NS)
    rules = [f'start: {n} {lit("<tool_call>")} "\\n" {repeat("invoke", parallel, choice)} {n} {lit("</tool_call>")}\n',
             f"invoke: {alternatives(len(chosen))}\n"]

    def arg(i: int, j: int, key: str, schema, params) -> str:
        close = f"{NS}</{key}>"
        if may_be_string(schema):
            value = string_value(schema, f"s_{i}_{j}", lits(close, (NS,)))
            if value == f"s_{i}_{j}":
                rules.append(text_until(value, close, (NS,)))
            return f'{n} {lit(f"<{key}>")} {value}'
        return f'{n} {lit(f"<{key}>")} {value_json_rule(schema, params)} {lits(close, (NS,))}'

    rules += keyed_calls(chosen, arg, lambda tool, seq: f'{n} {lit("<invoke name=" + json.dumps(tool["function"]["name"]) + ">")} '
                                                      f'{seq} {n} "</invoke>\\n"')
    return GrammarSpec("lark", "".join(rules), tokens=M3_TOKENS)


FORMATS = (
    ChatFormat(name="minimax_m3", detect=lambda s: NS in s, call_markers=(NS + "<tool_call>",), parse=parse_m3,
               reasoning=M3_THINK, forced=forced_m3, priority=20),
    ChatFormat(name="minimax_m2", detect=lambda s: M2_OPEN in s, call_markers=(M2_OPEN,), parse=parse_m2,
               forced=forced_m2, priority=20),
    ChatFormat(name="minimax_m1", detect=lambda s: M1_OPEN in s and M1_CLOSE in s and "ai name=assistant" in s,
               call_markers=(M1_OPEN,), parse=parse_m1, reasoning=("<think>", "</think>"), forced=forced_m1,
               priority=20),
)
