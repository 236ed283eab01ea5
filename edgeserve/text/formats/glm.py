"""GLM-style tool calls, one `<tool_call>` per call with the arguments as key / value tags:

    <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>

(GLM-4.6, Ling 3.0 and Laguna XS put newlines between the tags; GLM-4.7, Spark 2.5 and Laguna S none; both read
the same.) Values are text typed by the tool's schema: strings as written, other types as JSON. A `<tool_call>`
holding JSON (the hermes format) is not a call of this format and stays text.

- "glm_4_7": GLM-4.7-Flash, Spark 2.5 (compact markup).
- "glm_4_6": GLM-4.6 (a newline after the name and after each tag).
- "ling3": Ling 3.0 / Bailing V3: GLM-4.6's markup; it may call before closing its thought; `<|role_end|>`
  spelled out as text ends the turn.
- "laguna": poolside Laguna: compact markup; `</assistant>` spelled out as text ends the turn.
"""

from __future__ import annotations

import re

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall
from edgeserve.text.formats.tag_blocks import (Block, alternatives, chosen_tools, cut_calls, dumps, keyed_calls, lit,
                                               repeat, tagged_arg, text_until, typed_params)
from edgeserve.text.grammar import GrammarSpec

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
TOKENS = (CALL_OPEN, CALL_CLOSE, KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE)  # special tokens in GLM's vocabulary

BLOCKS = (Block(CALL_OPEN, CALL_CLOSE),)
_NAME = re.compile(r"\s*([^\s<>{}\[\]\"]+)\s*")
_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.S)


def _read_call(body: str, ctx: CallContext) -> list[tuple[str, str, str]] | None:
    """The call of one `<tool_call>` block: a bare name, then key / value pairs and nothing else (one anchored
    match after another: linear, whatever the text)."""
    head = _NAME.match(body)
    args = typed_params(_ARG, body[head.end():], ctx, head.group(1), str.strip) if head else None
    return None if args is None else [(head.group(1), dumps(args), "")]


def parse_calls(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a reply with GLM-style `<tool_call>` blocks."""
    return cut_calls(text, BLOCKS, lambda _, body: _read_call(body, ctx), ctx)


def _forced(newline: bool):
    nl = ' "\\n"' if newline else ""

    def forced(tools: list[dict], choice: str | None, parallel: bool) -> GrammarSpec:
        """GLM `<tool_call>` blocks: string values as text up to `</arg_value>`, the others JSON of their
        schema."""
        chosen = chosen_tools(tools, choice)
        rules = [f"start: {repeat('call', parallel, choice, chr(10) if newline else '')}\n",
                 f"call: {lit(CALL_OPEN)} ({alternatives(len(chosen))}) {lit(CALL_CLOSE)}\n",
                 text_until("str_value", VALUE_CLOSE)]
        rules += keyed_calls(
            chosen, tagged_arg(lambda key: f"{lit(KEY_OPEN)} {lit(key)} {lit(KEY_CLOSE)}{nl} {lit(VALUE_OPEN)}",
                               VALUE_CLOSE, nl),
            lambda tool, seq: f"{lit(tool['function']['name'])}{nl} {seq}")
        return GrammarSpec("lark", "".join(rules), tokens=TOKENS)
    return forced


def _is_glm(source: str) -> bool:
    return KEY_OPEN in source and CALL_OPEN in source


def _newline_style(source: str) -> bool:
    return any(s in source for s in ("</arg_key>\n", "\n<arg_key>", "</arg_key>\\n", "\\n<arg_key>"))


def _is_ling(source: str) -> bool:
    return _is_glm(source) and "<|role_end|>" in source


def _is_laguna(source: str) -> bool:
    return _is_glm(source) and "<assistant>" in source


FORMATS = (
    ChatFormat(name="ling3", detect=_is_ling, call_markers=(CALL_OPEN,), parse=parse_calls, calls_in_reasoning=True,
               stop=("<|role_end|>",), forced=_forced(True), priority=30, raw_thought_untagged=True),
    ChatFormat(name="laguna", detect=_is_laguna, call_markers=(CALL_OPEN,), parse=parse_calls,
               stop=("</assistant>",), forced=_forced(False), priority=30),
    ChatFormat(name="glm_4_6", detect=lambda s: _is_glm(s) and _newline_style(s), call_markers=(CALL_OPEN,),
               parse=parse_calls, forced=_forced(True), priority=35),
    ChatFormat(name="glm_4_7", detect=_is_glm, call_markers=(CALL_OPEN,), parse=parse_calls, forced=_forced(False),
               priority=40),
)
