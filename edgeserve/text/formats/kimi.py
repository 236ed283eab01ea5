"""Moonshot Kimi's tool calls.

- "kimi_k2" (Kimi K2, K2-Instruct, K2-Thinking): a section of calls, each with its id `functions.NAME:INDEX` (the
  call's id) and JSON arguments:

      <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}
      <|tool_call_end|>...<|tool_calls_section_end|>

  K2-Thinking may call from inside its thought; section and end markers may be missing.
- "kimi_k3": Kimi K3's XTML message built from `<|open|>` / `<|close|>` / `<|sep|>`: the prompt opens the thought
  (`<|open|>think<|sep|>`), the answer is `<|open|>response<|sep|>...<|close|>response<|sep|>`, calls come in
  `<|open|>tools<|sep|>` as `<|open|>call tool="NAME" index="1"<|sep|>` with one
  `<|open|>argument key="KEY" type="TYPE"<|sep|>VALUE<|close|>argument<|sep|>` per argument, and
  `<|close|>message<|sep|>` ends the message. The response start is a call marker (it ends the thought), so the
  whole answer is held back and unwrapped by the parser.
"""

from __future__ import annotations

import json
import re

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall
from edgeserve.text.formats.cut_call import tail_cut
from edgeserve.text.formats.tag_blocks import (Block, alternatives, args_json_rule, chosen_tools, cut_calls, dumps,
                                               json_object_text, keyed_calls, lit, lits, may_be_string, param_schema,
                                               repeat, section_calls, string_value, text_until, typed,
                                               value_json_rule)
from edgeserve.text.grammar import GrammarSpec

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGS_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
K2_TOKENS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGS_BEGIN, CALL_END)

K2_BLOCKS = (Block(SECTION_BEGIN, SECTION_END, to_end=True), Block(CALL_BEGIN, CALL_END, to_end=True))
_K2_ID = re.compile(r"\s*((?:functions\.)?([^\s:<>]+)(?::\d+)?)\s*$")


def _read_k2_block(opener: str, body: str) -> list[tuple[str, str, str]] | None:
    """The calls of one K2 section (or bare calls): each `functions.NAME:IDX` then its JSON object arguments."""
    return section_calls(opener, body, SECTION_BEGIN, CALL_BEGIN, CALL_END, _read_k2_call)


def _read_k2_call(piece: str) -> tuple[str, str, str] | None:
    ident, sep, args_text = piece.partition(ARGS_BEGIN)
    who, args = _K2_ID.match(ident), json_object_text(args_text)
    if not sep or who is None or args is None:
        return None
    return who.group(2), args, who.group(1)


def parse_k2(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a Kimi K2 reply; each call's id is its `functions.NAME:INDEX`."""
    return cut_calls(text, K2_BLOCKS, _read_k2_block, ctx)


def forced_k2(tools: list[dict], choice: str | None, parallel: bool) -> GrammarSpec:
    """A Kimi K2 call section: `functions.NAME:INDEX` ids and JSON arguments of each tool's schema."""
    chosen = chosen_tools(tools, choice)
    rules = [f"start: {lit(SECTION_BEGIN)} {repeat('call', parallel, choice)} {lit(SECTION_END)}\n",
             f"call: {lit(CALL_BEGIN)} ({alternatives(len(chosen))}) {lit(CALL_END)}\n",
             "INDEX: /[0-9]{1,3}/\n"]
    rules += [f'fn_{i}: {lit("functions." + t["function"]["name"] + ":")} INDEX {lit(ARGS_BEGIN)} {args_json_rule(t)}\n'
              for i, t in enumerate(chosen)]
    return GrammarSpec("lark", "".join(rules), tokens=K2_TOKENS)


# --- Kimi K3 ----------------------------------------------------------------------------------------------------

OPEN, CLOSE, SEP = "<|open|>", "<|close|>", "<|sep|>"
K3_TOKENS = (OPEN, CLOSE, SEP, "<|end_of_msg|>")
THINK = (f"{OPEN}think{SEP}", f"{CLOSE}think{SEP}")
RESPONSE = (f"{OPEN}response{SEP}", f"{CLOSE}response{SEP}")
TOOLS = (f"{OPEN}tools{SEP}", f"{CLOSE}tools{SEP}")
MESSAGE_END = f"{CLOSE}message{SEP}"

_K3_MESSAGE = re.compile(
    r"(?:" + re.escape(RESPONSE[0]) + r"(?P<response>.*?)(?:" + re.escape(RESPONSE[1]) + r"|(?=" + re.escape(TOOLS[0])
    + r"|" + re.escape(MESSAGE_END) + r")|$))?\s*(?:(?P<tools>" + re.escape(TOOLS[0]) + r".*?" + re.escape(TOOLS[1])
    + r"))?\s*(?:" + re.escape(MESSAGE_END) + r")?\s*(?:<\|end_of_msg\|>)?\s*$", re.S)
_K3_CALL = re.compile(re.escape(OPEN) + r'call tool="([^"]*)"[^<]*?' + re.escape(SEP) + r"(.*?)" + re.escape(CLOSE)
                      + r"call" + re.escape(SEP), re.S)
_K3_ARG = re.compile(re.escape(OPEN) + r'argument key="([^"]*)"(?: type="([^"]*)")?[^<]*?' + re.escape(SEP) + r"(.*?)"
                     + re.escape(CLOSE) + r"argument" + re.escape(SEP), re.S)


def parse_k3(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a Kimi K3 message from its response (or tools) section on: the response's text is
    the content; the tools section's calls to known functions become calls (else the section stays content)."""
    m = _K3_MESSAGE.match(text)
    if m is None or (m.group("response") is None and m.group("tools") is None):
        return text, []
    content = m.group("response") or ""
    section = m.group("tools")
    if section is None:
        return content, []
    calls = _k3_calls(section, ctx)
    return (content, calls) if calls is not None else (content + section, [])


def _k3_calls(section: str, ctx: CallContext) -> list[ToolCall] | None:
    body = section[len(TOOLS[0]): -len(TOOLS[1])]
    calls, pos = [], 0
    for m in _K3_CALL.finditer(body):
        if body[pos:m.start()].strip() or m.group(1) not in ctx.known:
            return None
        args = {}
        for key, declared, value in _K3_ARG.findall(m.group(2)):
            args[key] = value if declared == "string" else typed(value, param_schema(ctx, m.group(1), key))
        calls.append(ToolCall(m.group(1), dumps(args)))
        pos = m.end()
    return calls if calls and not body[pos:].strip() else None


def forced_k3(tools: list[dict], choice: str | None, parallel: bool) -> GrammarSpec:
    """Kimi K3's reply as calls only: the rest of the thought the prompt opened (free text up to its close tag), an
    empty response, then the tools section and the message end. The grammar covers the thought itself
    (GrammarSpec.own_thought): `think` cannot end on its close tag, three tokens, two of them special."""
    chosen = chosen_tools(tools, choice)
    rules = [f"start: thought ({lits(RESPONSE[0] + RESPONSE[1], K3_TOKENS)})? {lits(TOOLS[0], K3_TOKENS)} "
             f"{repeat('call', parallel, choice)} {lits(TOOLS[1] + MESSAGE_END, K3_TOKENS)}\n",
             text_until("thought", THINK[1], K3_TOKENS),
             f"call: {alternatives(len(chosen))}\n",
             text_until("str_value", f"{CLOSE}argument{SEP}", K3_TOKENS)]

    def arg(i: int, j: int, key: str, schema, params) -> str:
        kind = schema.get("type") if isinstance(schema, dict) and isinstance(schema.get("type"), str) else "string"
        kind = "number" if kind == "integer" else kind  # the template's type names (xtml_type)
        head = lits(f'{OPEN}argument key={json.dumps(key)} type={json.dumps(kind)}{SEP}', K3_TOKENS)
        if may_be_string(schema):
            return f"{head} {string_value(schema, 'str_value', lits(f'{CLOSE}argument{SEP}', K3_TOKENS))}"
        return f"{head} {value_json_rule(schema, params)} {lits(f'{CLOSE}argument{SEP}', K3_TOKENS)}"

    def call(tool: dict, seq: str) -> str:
        head = lits(f'{OPEN}call tool={json.dumps(tool["function"]["name"])} index=', K3_TOKENS)
        return f'{head} "\\"" /[0-9]{{1,3}}/ "\\"" {lit(SEP)} {seq} {lits(f"{CLOSE}call{SEP}", K3_TOKENS)}'

    rules += keyed_calls(chosen, arg, call)
    return GrammarSpec("lark", "".join(rules), tokens=K3_TOKENS, own_thought=True)


FORMATS = (
    ChatFormat(name="kimi_k2", detect=lambda s: SECTION_BEGIN in s, call_markers=(SECTION_BEGIN, CALL_BEGIN),
               parse=parse_k2, reasoning=("<think>", "</think>"), calls_in_reasoning=True, forced=forced_k2, priority=20,
               cut=tail_cut(r"(?:<\|tool_calls_section_begin\|>)?\s*<\|tool_call_begin\|>\s*"
                            r"(?P<id>(?:functions\.)?(?P<name>[^\s:<>]+)(?::\d+)?)\s*"
                            r"<\|tool_call_argument_begin\|>(?P<args>.*)")),
    ChatFormat(name="kimi_k3", detect=lambda s: OPEN in s and SEP in s and CLOSE in s,
               call_markers=(RESPONSE[0], TOOLS[0], MESSAGE_END), parse=parse_k3, reasoning=THINK,
               calls_in_reasoning=True, forced=forced_k3, priority=20, wraps_answer=True,
               raw_thought_untagged=True),
)
