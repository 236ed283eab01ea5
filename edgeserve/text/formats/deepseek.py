"""DeepSeek's tool calls in full-width special tokens: V3.1 and the R1 family (R1 distills of Llama / Qwen,
llama.cpp's own R1 template).

- "deepseek_v3_1": `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>...
  <｜tool▁calls▁end｜>`; its template keys reasoning on `thinking` (or `enable_thinking`).
- "deepseek_r1": the same section, each call `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{json}
  \\n```<｜tool▁call▁end｜>`.

Both read either spelling, a call without its section markers, and a section cut short (no end markers).
"""

from __future__ import annotations

import json
import re

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall
from edgeserve.text.formats.tag_blocks import (Block, alternatives, args_json_rule, chosen_tools, cut_calls,
                                               json_object_text, lit, repeat, section_calls)
from edgeserve.text.grammar import GrammarSpec

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
TOKENS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)  # single special tokens in DeepSeek's vocabularies
FENCE = "```json"

BLOCKS = (Block(CALLS_BEGIN, CALLS_END, to_end=True), Block(CALL_BEGIN, CALL_END, to_end=True))
_R1_CALL = re.compile(r"\s*function\s*" + SEP + r"\s*([^\s`]+)\s*```(?:json)?\s*(.*?)\s*```\s*$", re.S)


def _read_block(opener: str, body: str) -> list[tuple[str, str, str]] | None:
    """The calls of one section (or bare calls): None unless every piece is a call with an object argument."""
    return section_calls(opener, body, CALLS_BEGIN, CALL_BEGIN, CALL_END,
                         lambda piece: (*call, "") if (call := _read_call(piece)) is not None else None)


def _read_call(piece: str) -> tuple[str, str] | None:
    r1 = _R1_CALL.match(piece)
    if r1 is not None:
        args = json_object_text(r1.group(2))
        return (r1.group(1), args) if args is not None else None
    name, sep, args_text = piece.partition(SEP)
    args = json_object_text(args_text) if sep else None
    if args is None or not name.strip() or any(c.isspace() for c in name.strip()):
        return None
    return name.strip(), args


def parse_calls(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a reply in either DeepSeek spelling."""
    return cut_calls(text, BLOCKS, _read_block, ctx)


def _forced(call_body, sep: str):
    def forced(tools: list[dict], choice: str | None, parallel: bool) -> GrammarSpec:
        chosen = chosen_tools(tools, choice)
        rules = [f"start: {lit(CALLS_BEGIN)} {repeat('call', parallel, choice, sep)} {lit(CALLS_END)}\n",
                 f"call: {lit(CALL_BEGIN)} ({alternatives(len(chosen))}) {lit(CALL_END)}\n"]
        rules += [f"fn_{i}: {call_body(t)}\n" for i, t in enumerate(chosen)]
        return GrammarSpec("lark", "".join(rules), tokens=TOKENS)
    return forced


def _v3_1_body(tool: dict) -> str:
    return f"{lit(tool['function']['name'])} {lit(SEP)} {args_json_rule(tool)}"


def _r1_body(tool: dict) -> str:
    return (f'"function" {lit(SEP)} {lit(tool["function"]["name"] + chr(10) + FENCE + chr(10))} '
            f'{args_json_rule(tool)} {lit(chr(10) + "```")}')


V3_1_SYNTAX = f"{CALLS_BEGIN}{CALL_BEGIN}tool_call_name{SEP}tool_call_arguments{CALL_END}{{{{additional_tool_calls}}}}{CALLS_END}"
R1_SYNTAX = (f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}tool_call_name\n{FENCE}\ntool_call_arguments\n```{CALL_END}"
             f"{{{{additional_tool_calls}}}}{CALLS_END}")


def tools_prompt(tools: list[dict], syntax: str) -> str:
    """DeepSeek's documented tools section of the system prompt: each tool's name, description and parameters
    schema, then the call syntax the model was trained to write (its templates render calls but list no tools)."""
    parts = ["## Tools\nYou have access to the following tools:"]
    for tool in tools:
        fn = tool["function"]
        parts.append(f"### {fn['name']}\nDescription: {fn.get('description', '')}\n\n"
                     f"Parameters: {json.dumps(fn.get('parameters') or {}, ensure_ascii=False)}")
    parts.append(f"IMPORTANT: ALWAYS adhere to this exact format for tool use:\n{syntax.format()}\n\nWhere:\n"
                 "- `tool_call_name` must be an exact match to one of the available tools\n"
                 "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
                 "- For multiple tool calls, chain them directly without separators or spaces")
    return "\n\n".join(parts)


def _writes_deepseek_calls(source: str) -> bool:
    return SEP in source and CALL_BEGIN in source


FORMATS = (
    ChatFormat(name="deepseek_v3_1", detect=lambda s: _writes_deepseek_calls(s) and FENCE not in s,
               call_markers=(CALLS_BEGIN, CALL_BEGIN), parse=parse_calls, forced=_forced(_v3_1_body, ""),
               thinking_switches=("thinking", "enable_thinking"), priority=20,
               tools_prompt=lambda tools: tools_prompt(tools, V3_1_SYNTAX)),
    ChatFormat(name="deepseek_r1", detect=lambda s: _writes_deepseek_calls(s) and FENCE in s,
               call_markers=(CALLS_BEGIN, CALL_BEGIN), parse=parse_calls, forced=_forced(_r1_body, "\n"),
               priority=20, tools_prompt=lambda tools: tools_prompt(tools, R1_SYNTAX)),
)
