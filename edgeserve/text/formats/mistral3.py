"""Mistral Small 3.2, Devstral, Ministral 3 and Magistral: calls as `[TOOL_CALLS]NAME[ARGS]{...}`.

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}

One `[TOOL_CALLS]` per call (a run of `NAME[ARGS]{...}` after one marker is read too); Mistral Small 3.2 writes
the call's id after `[CALL_ID]` (a call without one gets a fresh 9-character id, the only kind that template
accepts back). The older JSON-list form `[TOOL_CALLS][{"name": ..., "arguments": ...}]`
(Mistral Nemo, the "mistral" format) is read as well, as fine-tunes mix them. Ministral 3 / Magistral think
between `[THINK]` and `[/THINK]` ("magistral"); the others do not ("mistral3"). All five markers are single
special tokens of these vocabularies.

Detected by `[TOOL_CALLS]` and `[ARGS]` in the template (Nemo's has no `[ARGS]`), with `[THINK]` for
"magistral".
"""

from __future__ import annotations

import secrets
import string
from typing import Any, Callable

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall
from edgeserve.text.formats.markup import Read, arguments_json, call_list, call_rules, json_at, lit, scan, skip_space

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
THINK = ("[THINK]", "[/THINK]")
TOKENS = (TOOL_CALLS, ARGS, CALL_ID)


def _read_calls(text: str, pos: int, ctx: CallContext) -> Read | None:
    """The calls after one `[TOOL_CALLS]`: a JSON list of call objects, or one or more `NAME[ARGS]{...}`."""
    start = skip_space(text, pos)
    if text.startswith(("[", "{"), start) and not text.startswith(TOKENS, start):
        value = json_at(text, start)
        calls = call_list(value[0], ctx) if value is not None else None
        return Read(calls, "", value[1]) if calls else None
    calls: list[ToolCall] = []
    while True:
        one = _read_named(text, pos, ctx)
        if one is None:
            break
        calls.append(one[0])
        pos = one[1]
    return Read(calls, "", pos) if calls else None


def _read_named(text: str, pos: int, ctx: CallContext) -> tuple[ToolCall, int] | None:
    """`NAME[CALL_ID]ID[ARGS]{...}` (the id optional) at `pos`: (the call, where it ends), or None."""
    args_at = text.find(ARGS, pos)
    if args_at < 0:
        return None
    head = text[pos:args_at]
    name, _, call_id = head.partition(CALL_ID)
    name = name.strip()
    if name not in ctx.known or TOOL_CALLS in head:
        return None
    value = json_at(text, args_at + len(ARGS))
    args = arguments_json(value[0]) if value is not None else None
    if args is None:
        return None
    return ToolCall(name, args, call_id.strip() or mistral_id()), value[1]


def mistral_id() -> str:
    """A fresh call id as Mistral's templates require them: 9 letters and digits."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def parse(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a reply from its first `[TOOL_CALLS]` on."""
    return scan(text, {TOOL_CALLS: _read_calls}, ctx)


def forced(tools: list[dict], choice: str | None, parallel: bool) -> Any:
    """The Lark grammar of a reply that is `[TOOL_CALLS]NAME[ARGS]{...}` calls (one unless `parallel`)."""
    from edgeserve.text.grammar import GrammarSpec, json_rule

    start = "start: call+\n" if parallel and choice is None else "start: call\n"
    rules = call_rules(tools, choice, lambda name, args: f"{lit(TOOL_CALLS)} {lit(name)} {lit(ARGS)} {args}",
                       json_rule)
    return GrammarSpec("lark", start + rules, tokens=TOKENS)


def _detect(think: bool) -> Callable[[str], bool]:
    def detect(source: str) -> bool:
        return TOOL_CALLS in source and ARGS in source and (THINK[0] in source) == think
    return detect


FORMATS = (
    ChatFormat("magistral", _detect(True), call_markers=(TOOL_CALLS,), parse=parse, reasoning=THINK,
               forced=forced, priority=20),
    ChatFormat("mistral3", _detect(False), call_markers=(TOOL_CALLS,), parse=parse, forced=forced, priority=20),
)
