"""ByteDance Seed-OSS tool calls and thoughts: `<seed:think>...</seed:think>`, then calls as

    <seed:tool_call>
    <function=NAME>
    <parameter=KEY>VALUE</parameter>
    </function>
    </seed:tool_call>

Values are text typed by the tool's schema (strings exactly as written, newlines included); its template sizes the
thought with `thinking_budget` rather than switching it.
"""

from __future__ import annotations

import re

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall
from edgeserve.text.formats.tag_blocks import (Block, alternatives, chosen_tools, cut_calls, dumps, keyed_calls, lit,
                                               repeat, tagged_arg, text_until, typed_params)
from edgeserve.text.grammar import GrammarSpec

CALL_OPEN, CALL_CLOSE = "<seed:tool_call>", "</seed:tool_call>"
THINK = ("<seed:think>", "</seed:think>")
TOKENS = (CALL_OPEN, CALL_CLOSE, *THINK)  # single special tokens in Seed-OSS's vocabulary

BLOCKS = (Block(CALL_OPEN, CALL_CLOSE),)
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*$", re.S)
_PARAM = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>\s*", re.S)


def _read(block: str, ctx: CallContext) -> list[tuple[str, str, str]] | None:
    m = _FUNCTION.match(block)
    args = typed_params(_PARAM, m.group(2), ctx, m.group(1).strip(), str.strip) if m else None
    return None if args is None else [(m.group(1).strip(), dumps(args), "")]


def parse_calls(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a Seed-OSS reply."""
    return cut_calls(text, BLOCKS, lambda _, body: _read(body, ctx), ctx)


def forced(tools: list[dict], choice: str | None, parallel: bool) -> GrammarSpec:
    """`<seed:tool_call>` blocks: string values as text up to `</parameter>`, the others JSON of their schema."""
    chosen = chosen_tools(tools, choice)
    rules = [f"start: {repeat('call', parallel, choice, chr(10))}\n",
             f"call: {lit(CALL_OPEN)} \"\\n\" ({alternatives(len(chosen))}) {lit(CALL_CLOSE)}\n",
             text_until("str_value", "</parameter>")]
    rules += keyed_calls(
        chosen, tagged_arg(lambda key: lit(f"<parameter={key}>"), "</parameter>"),
        lambda tool, seq: f'{lit("<function=" + tool["function"]["name"] + ">" + chr(10))} {seq} "</function>\\n"')
    return GrammarSpec("lark", "".join(rules), tokens=TOKENS)


FORMATS = (
    ChatFormat(name="seed_oss", detect=lambda s: CALL_OPEN in s, call_markers=(CALL_OPEN,), parse=parse_calls,
               reasoning=THINK, forced=forced, thinking_switches=(), priority=20),
)
