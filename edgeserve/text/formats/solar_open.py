"""Upstage Solar Open: calls as

    <|tool_calls|><|tool_call:begin|>ID<|tool_call:name|>NAME<|tool_call:args|>{...}<|tool_call:end|>...<|calls|>

(ID: 10 lowercase letters / digits; `<|calls|>` ends the reply). The prompt ends with `<|begin|>assistant`, so a
reply is `<|think|>THOUGHT<|end|>` and / or `<|content|>ANSWER<|end|>` (a later message may start again with
`<|begin|>assistant`; that markup is dropped). The template switches reasoning with `reasoning_effort`, not a
boolean. Detected by `<|tool_call:begin|>`.
"""

from __future__ import annotations

import secrets
import string
from typing import Any

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall
from edgeserve.text.formats.markup import (Read, arguments_json, block_reader, call_rules, json_at, lit, scan,
                                           skip_space, wrapper_reader)

CALLS, CALLS_END = "<|tool_calls|>", "<|calls|>"
BEGIN, NAME, ARGS, END = "<|tool_call:begin|>", "<|tool_call:name|>", "<|tool_call:args|>", "<|tool_call:end|>"
THINK = ("<|think|>", "<|end|>")
CONTENT, MESSAGE_END, ASSISTANT = "<|content|>", "<|end|>", "<|begin|>assistant"
TOKENS = (CALLS, CALLS_END, BEGIN, NAME, ARGS, END, THINK[0], CONTENT, MESSAGE_END, "<|begin|>")


def _read_call(text: str, pos: int, ctx: CallContext) -> Read | None:
    """`ID<|tool_call:name|>NAME<|tool_call:args|>{...}<|tool_call:end|>` after `<|tool_call:begin|>`."""
    name_at, args_at = text.find(NAME, pos), text.find(ARGS, pos)
    if name_at < 0 or args_at < name_at:
        return None
    name = text[name_at + len(NAME):args_at].strip()
    value = json_at(text, args_at + len(ARGS)) if name in ctx.known else None
    args = arguments_json(value[0]) if value is not None else None
    if args is None:
        return None
    end = skip_space(text, value[1])
    end = end + len(END) if text.startswith(END, end) else value[1]
    return Read([ToolCall(name, args, text[pos:name_at].strip() or _call_id())], "", end)


def _call_id() -> str:
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(10))


def _read_assistant(text: str, pos: int, ctx: CallContext) -> Read | None:
    """A repeated `<|begin|>assistant` before a message of the reply: dropped."""
    return Read([], "", pos) if text.startswith((CONTENT, CALLS, THINK[0]), pos) else None


_READERS = {CALLS: block_reader(BEGIN, _read_call, CALLS_END), BEGIN: _read_call,
            CONTENT: wrapper_reader(MESSAGE_END), ASSISTANT: _read_assistant}


def parse(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a reply from its first call, content or assistant marker on."""
    return scan(text, _READERS, ctx)


def forced(tools: list[dict], choice: str | None, parallel: bool) -> Any:
    """The grammar of a `<|tool_calls|>...<|calls|>` reply."""
    from edgeserve.text.grammar import GrammarSpec, json_rule

    def call(name: str, args: str) -> str:
        return f"{lit(BEGIN)} /[a-z0-9]{{10}}/ {lit(NAME)} {lit(name)} {lit(ARGS)} {args} {lit(END)}"

    items = "call+" if parallel and choice is None else "call"
    return GrammarSpec("lark", f"start: {lit(CALLS)} {items} {lit(CALLS_END)}\n"
                       + call_rules(tools, choice, call, json_rule), tokens=TOKENS)


FORMATS = (
    ChatFormat("solar_open", lambda s: BEGIN in s and NAME in s, call_markers=(CALLS, BEGIN, CONTENT, ASSISTANT),
               parse=parse, reasoning=THINK, stop=(CALLS_END,), forced=forced, thinking_switches=(), priority=20, wraps_answer=True),
)
