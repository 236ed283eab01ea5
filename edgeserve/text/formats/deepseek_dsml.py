"""DeepSeek V3.2 and V4 tool calls in DSML markup:

    <｜DSML｜function_calls>                     (V4 and V4-Flash: <｜DSML｜tool_calls>)
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true">text</｜DSML｜parameter>
    <｜DSML｜parameter name="N" string="false">42</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

`string="true"` values are text, `string="false"` ones JSON. The model may call from inside an open thought (the
block then ends the reasoning). Both formats read both block names. In a forced call a text value ends at its
first `</` (the closing tag holds the `｜DSML｜` token, which may be special: text cannot stop on it).
"""

from __future__ import annotations

import json
import re

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall
from edgeserve.text.formats.tag_blocks import (Block, alternatives, chosen_tools, consecutive, cut_calls, invoke_calls,
                                               keyed_calls, lit, may_be_string, param_schema, repeat, string_value,
                                               text_until, typed, value_json_rule)
from edgeserve.text.grammar import GrammarSpec

DSML = "｜DSML｜"  # one special token in the V3.2 / V4 vocabularies
BLOCK_NAMES = ("function_calls", "tool_calls")  # V3.2's block name, V4's

BLOCKS = tuple(Block(f"<{DSML}{b}>", f"</{DSML}{b}>", to_end=True) for b in BLOCK_NAMES)
_INVOKE = re.compile(f'\\s*<{DSML}invoke name="([^"]*)">(.*?)</{DSML}invoke>\\s*', re.S)
_PARAM = re.compile(f'\\s*<{DSML}parameter name="([^"]*)" string="(true|false)">(.*?)</{DSML}parameter>\\s*', re.S)


def _read_block(body: str, ctx: CallContext) -> list[tuple[str, str, str]] | None:
    return invoke_calls(_INVOKE, body, lambda inv: _arguments(inv.group(1), inv.group(2), ctx))


def _arguments(name: str, body: str, ctx: CallContext) -> dict | None:
    params = consecutive(_PARAM, body)
    if params is None:
        return None
    args = {}
    for key, is_string, value in (p.groups() for p in params):
        if is_string == "true":
            args[key] = value
        else:
            try:
                args[key] = json.loads(value)
            except json.JSONDecodeError:
                args[key] = typed(value, param_schema(ctx, name, key))
    return args


def parse_calls(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a reply with DSML call blocks."""
    return cut_calls(text, BLOCKS, lambda _, body: _read_block(body, ctx), ctx)


def _forced(block: str):
    def forced(tools: list[dict], choice: str | None, parallel: bool) -> GrammarSpec:
        """Calls in a DSML block: string parameters as text, the others as JSON of their schema."""
        chosen = chosen_tools(tools, choice)
        d = lit(DSML)
        rules = [f'start: "<" {d} "{block}>\\n" {repeat("invoke", parallel, choice)} "</" {d} "{block}>"\n',
                 f"invoke: {alternatives(len(chosen))}\n",
                 text_until("str_value", f"</{DSML}parameter>", (DSML,))]

        def arg(i: int, j: int, key: str, schema, params) -> str:
            close = f'"</" {d} "parameter>"'
            head = f'"<" {d} {lit("parameter name=" + json.dumps(key) + " string=")}'
            if may_be_string(schema):
                return f'{head} "\\"true\\">" {string_value(schema, "str_value", close)} "\\n"'
            return f'{head} "\\"false\\">" {value_json_rule(schema, params)} "</" {d} "parameter>\\n"'

        rules += keyed_calls(chosen, arg, lambda tool, seq: f'"<" {d} '
                             f'{lit("invoke name=" + json.dumps(tool["function"]["name"]) + ">" + chr(10))} {seq} '
                             f'"</" {d} "invoke>\\n"')
        return GrammarSpec("lark", "".join(rules), tokens=(DSML,))
    return forced


def _is_dsml(source: str) -> bool:
    return DSML in source


MARKERS = tuple(b.open for b in BLOCKS)

FORMATS = (
    ChatFormat(name="deepseek_v3_2", detect=lambda s: _is_dsml(s) and "function_calls" in s, call_markers=MARKERS,
               parse=parse_calls, calls_in_reasoning=True, forced=_forced("function_calls"),
               thinking_switches=("thinking", "enable_thinking"), priority=20),
    ChatFormat(name="deepseek_v4", detect=lambda s: _is_dsml(s) and "function_calls" not in s, call_markers=MARKERS,
               parse=parse_calls, calls_in_reasoning=True, forced=_forced("tool_calls"),
               thinking_switches=("thinking", "enable_thinking"), priority=20),
)
