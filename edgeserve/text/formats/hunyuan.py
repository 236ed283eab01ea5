"""Tencent Hunyuan 3 (Hy3): GLM-like calls with `:opensource` tags,

    <tool_calls:opensource>
    <tool_call:opensource>NAME<tool_sep:opensource>
    <arg_key:opensource>KEY</arg_key:opensource>
    <arg_value:opensource>VALUE</arg_value:opensource>
    </tool_call:opensource>
    </tool_calls:opensource>

VALUE is text, typed by the parameter's schema (the template writes non-strings as JSON). Reasoning is
`<think:opensource>...</think:opensource>`; the template switches it with `reasoning_effort` ("no_think", "low",
"high"), not a boolean. Detected by its `hy_Assistant` and `tool_sep` tokens.
"""

from __future__ import annotations

import json
from typing import Any

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall
from edgeserve.text.formats.markup import (Read, block_reader, call_rules, free_text, lit, param_sequence,
                                           parameters, scan, skip_space)
from edgeserve.text.xml_tool_calls import resolve_ref, typed_value

TAG = ":opensource"
CALLS = (f"<tool_calls{TAG}>", f"</tool_calls{TAG}>")
CALL = (f"<tool_call{TAG}>", f"</tool_call{TAG}>")
SEP = f"<tool_sep{TAG}>"
KEY = (f"<arg_key{TAG}>", f"</arg_key{TAG}>")
VALUE = (f"<arg_value{TAG}>", f"</arg_value{TAG}>")
THINK = (f"<think{TAG}>", f"</think{TAG}>")
TOKENS = (*CALLS, *CALL, SEP, *KEY, *VALUE, *THINK)


def _read_call(text: str, pos: int, ctx: CallContext) -> Read | None:
    """`NAME<tool_sep>` + key / value pairs + `</tool_call>` after `<tool_call>`."""
    sep = text.find(SEP, pos)
    name = text[pos:sep].strip() if sep >= 0 else ""
    if name not in ctx.known:
        return None
    schema = ctx.schemas.get(name) or {}
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    args: dict[str, Any] = {}
    at = skip_space(text, sep + len(SEP))
    while text.startswith(KEY[0], at):
        key_end = text.find(KEY[1], at)
        value_at = skip_space(text, key_end + len(KEY[1])) if key_end >= 0 else -1
        value_end = text.find(VALUE[1], value_at) if value_at >= 0 and text.startswith(VALUE[0], value_at) else -1
        if value_end < 0:
            return None
        key = text[at + len(KEY[0]):key_end]
        args[key] = typed_value(text[value_at + len(VALUE[0]):value_end], resolve_ref(props.get(key), schema))
        at = skip_space(text, value_end + len(VALUE[1]))
    if not text.startswith(CALL[1], at):
        return None
    return Read([ToolCall(name, json.dumps(args, ensure_ascii=False))], "", at + len(CALL[1]))


_READERS = {CALLS[0]: block_reader(CALL[0], _read_call, CALLS[1]), CALL[0]: _read_call}


def parse(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a reply from its first `<tool_calls:opensource>` (or `<tool_call:opensource>`) on."""
    return scan(text, _READERS, ctx)


def forced(tools: list[dict], choice: str | None, parallel: bool) -> Any:
    """The grammar of a `<tool_calls:opensource>` block: each declared parameter in schema order (required ones
    always), strings as text, other values as JSON."""
    from edgeserve.text.grammar import GrammarSpec, json_rule

    extra: list[str] = []

    def call(name: str, args_rule: str) -> str:
        params = next(parameters(t) for t in tools if t["function"]["name"] == name)
        seq = param_sequence(params, lambda key: f'{lit(KEY[0])} {lit(key)} {lit(KEY[1])} "\\n" {lit(VALUE[0])}',
                             VALUE[1], '"\\n"', json_rule, extra)
        return f'{lit(CALL[0])} {lit(name)} {lit(SEP)} "\\n" {seq} {lit(CALL[1])} "\\n"'

    items = "call+" if parallel and choice is None else "call"
    start = f'start: {lit(CALLS[0])} "\\n" {items} {lit(CALLS[1])}\n'
    rules = call_rules(tools, choice, call, json_rule)
    return GrammarSpec("lark", start + rules + "".join(extra) + free_text(VALUE[1]),
                       tokens=TOKENS)


FORMATS = (
    ChatFormat("hunyuan3", lambda s: "hy_Assistant" in s and "tool_sep" in s, call_markers=(CALLS[0], CALL[0]),
               parse=parse, reasoning=THINK, forced=forced, thinking_switches=(), priority=20),
)
