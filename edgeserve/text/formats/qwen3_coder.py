"""Qwen3-Coder, Qwen3.5 / 3.6 (and Nemotron 3 Nano, which writes the same): `<tool_call>` around `<function=NAME>`
with one `<parameter=ARG>VALUE</parameter>` per argument, each tag on its own line; values are text typed by the
tool's schema (edgeserve.text.xml_tool_calls reads and constrains them).

Qwen3.5 / 3.6 open the thought in the prompt and may write a call before `</think>` (or with none): the call ends
the thought there (`calls_in_reasoning`). Forced calls are constrained to this markup, not to a JSON wrapper.
"""

from __future__ import annotations

import json

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall
from edgeserve.text.xml_tool_calls import (CALL_TAGS, FUNCTION_OPEN, forced_call_grammar, parse_xml_calls,
                                           template_writes_xml_calls)


def parse(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls): every closed function block of an offered function, its values typed by its schema."""
    params = {name: ctx.schemas.get(name) or {} for name in ctx.known}
    content, found = parse_xml_calls(text, params)
    return content, [ToolCall(name, json.dumps(args, ensure_ascii=False)) for name, args in found]


def forced(tools: list[dict], choice: str | None, parallel: bool):
    """The grammar of a reply that is calls in this markup (edgeserve.text.xml_tool_calls.forced_call_grammar)."""
    from edgeserve.text.grammar import GrammarSpec, json_rule

    return GrammarSpec("lark", forced_call_grammar(tools, choice, parallel, json_rule), tokens=CALL_TAGS)


FORMATS = (ChatFormat("qwen3_coder", detect=template_writes_xml_calls, call_markers=(CALL_TAGS[0], FUNCTION_OPEN),
                      parse=parse, calls_in_reasoning=True, forced=forced, priority=500),)
