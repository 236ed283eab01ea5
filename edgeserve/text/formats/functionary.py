"""MeetKai functionary v3.1 and v3.2, and Fireworks' firefunction v2.

- "functionary_v31": `<function=NAME>{...}</function>` per call; the python tool as `<|python_tag|>` then its code
  (or JSON arguments) to the end of the reply. Detected by `<function=` and `<|python_tag|>` without
  Qwen3-Coder's `<parameter=`.
- "functionary_v32": the prompt ends with `>>>`, so a reply is messages `RECIPIENT\\nBODY` separated by `>>>`:
  `all` is the answer, any other recipient a call with JSON arguments (the python tool's body may be code). The
  whole reply is in this syntax: its call marker is the empty string (it holds from the start). Detected by
  `>>>all`.
- "firefunction_v2": ` functools[{"name": ..., "arguments": {...}}, ...]`. Detected by `functools[`.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall
from edgeserve.text.formats.markup import (Read, arguments_json, call_rules, json_at, json_list_reader, list_grammar,
                                           lit, object_call, scan, skip_space)

FUNCTION_OPEN, FUNCTION_CLOSE, PYTHON_TAG = "<function=", "</function>", "<|python_tag|>"
RECIPIENT, ANSWER = ">>>", "all"
FUNCTOOLS = "functools"
PYTHON = "python"


def _python_call(body: str, ctx: CallContext) -> ToolCall | None:
    """The python tool's call from its body: JSON arguments, or code."""
    if PYTHON not in ctx.known or not body.strip():
        return None
    value = json_at(body, 0)
    if value is not None and isinstance(value[0], dict) and not body[value[1]:].strip():
        return ToolCall(PYTHON, json.dumps(value[0], ensure_ascii=False))
    return ToolCall(PYTHON, json.dumps({"code": body}, ensure_ascii=False))


# --- v3.1 -----------------------------------------------------------------------------------------------------


def _read_function(text: str, pos: int, ctx: CallContext) -> Read | None:
    """`NAME>{...}</function>` after `<function=` (the closing tag may be missing)."""
    close = text.find(">", pos)
    if close < 0 or text[pos:close].strip() not in ctx.known:
        return None
    value = json_at(text, close + 1)
    args = arguments_json(value[0]) if value is not None else None
    if args is None:
        return None
    end = skip_space(text, value[1])
    end = end + len(FUNCTION_CLOSE) if text.startswith(FUNCTION_CLOSE, end) else value[1]
    return Read([ToolCall(text[pos:close].strip(), args)], "", end)


def _read_python(text: str, pos: int, ctx: CallContext) -> Read | None:
    call = _python_call(text[pos:], ctx)
    return Read([call], "", len(text)) if call is not None else None


def parse_v31(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a functionary v3.1 reply from its first `<function=` or `<|python_tag|>` on."""
    return scan(text, {FUNCTION_OPEN: _read_function, PYTHON_TAG: _read_python}, ctx)


def forced_v31(tools: list[dict], choice: str | None, parallel: bool) -> Any:
    """The grammar of `<function=NAME>{...}</function>` calls."""
    from edgeserve.text.grammar import GrammarSpec, json_rule

    start = "start: call+\n" if parallel and choice is None else "start: call\n"
    rules = call_rules(tools, choice, lambda n, a: f"{lit(FUNCTION_OPEN + n + '>')} {a} {lit(FUNCTION_CLOSE)}",
                       json_rule)
    return GrammarSpec("lark", start + rules, tokens=(PYTHON_TAG,))


# --- v3.2 -----------------------------------------------------------------------------------------------------


def parse_v32(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole functionary v3.2 reply: `all` messages are content, known recipients calls;
    a message that is neither stays as it was written."""
    kept: list[str] = []
    calls: list[ToolCall] = []
    for i, message in enumerate(text.split(RECIPIENT)):
        recipient, newline, body = message.partition("\n")
        call = _recipient_call(recipient.strip(), body, ctx) if newline else None
        if call is not None:
            calls.append(call)
        elif newline and recipient.strip() == ANSWER:
            kept.append(body)
        else:
            kept.append(message if i == 0 else RECIPIENT + message)
    content = "".join(kept)
    return (content.strip() if calls else content), calls


def _recipient_call(recipient: str, body: str, ctx: CallContext) -> ToolCall | None:
    if recipient == PYTHON:
        return _python_call(body, ctx)
    if recipient not in ctx.known:
        return None
    value = json_at(body, 0)
    args = arguments_json(value[0]) if value is not None and not body[value[1]:].strip() else None
    return ToolCall(recipient, args) if args is not None else None


def forced_v32(tools: list[dict], choice: str | None, parallel: bool) -> Any:
    """The grammar of a reply (after the prompt's `>>>`) that is `NAME\\n{...}` calls joined by `>>>`."""
    from edgeserve.text.grammar import GrammarSpec, json_rule

    start = f"start: call ({lit(RECIPIENT)} call)*\n" if parallel and choice is None else "start: call\n"
    return GrammarSpec("lark", start + call_rules(tools, choice, lambda n, a: f"{lit(n + chr(10))} {a}", json_rule))


# --- firefunction v2 ------------------------------------------------------------------------------------------


_FUNCTOOLS = json_list_reader()


def parse_firefunction(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a firefunction v2 reply from its first `functools` on."""
    return scan(text, {" " + FUNCTOOLS: _FUNCTOOLS, FUNCTOOLS: _FUNCTOOLS}, ctx)


def firefunction_vars(tools: list[dict] | None) -> dict[str, Any]:
    """The variables firefunction v2's template concatenates into its system prompt: `functions`, the offered tools
    as JSON (empty without tools, as Ollama's firefunction template writes nothing there), and `datetime`, today's
    date as llama.cpp supplies it ("Dec 02 2026")."""
    return {"functions": json.dumps(tools, ensure_ascii=False) if tools else "",
            "datetime": datetime.date.today().strftime("%b %d %Y")}


def forced_firefunction(tools: list[dict], choice: str | None, parallel: bool) -> Any:
    """The grammar of a ` functools[{"name": ..., "arguments": {...}}, ...]` reply."""
    from edgeserve.text.grammar import GrammarSpec, json_rule

    rules = call_rules(tools, choice, object_call, json_rule)
    return GrammarSpec("lark", list_grammar(lit(" " + FUNCTOOLS), parallel and choice is None, rules))


FORMATS = (
    ChatFormat("functionary_v31", lambda s: FUNCTION_OPEN in s and PYTHON_TAG in s and "<parameter=" not in s,
               call_markers=(FUNCTION_OPEN, PYTHON_TAG), parse=parse_v31, forced=forced_v31, priority=20),
    ChatFormat("functionary_v32", lambda s: RECIPIENT + ANSWER in s, call_markers=("",), parse=parse_v32,
               forced=forced_v32, priority=20, wraps_answer=True),
    ChatFormat("firefunction_v2", lambda s: FUNCTOOLS + "[" in s, call_markers=(" " + FUNCTOOLS, FUNCTOOLS),
               parse=parse_firefunction, forced=forced_firefunction, priority=20, template_vars=firefunction_vars),
)
