"""Cohere's Command R7B, Cohere2 MoE (North) and Command R+: calls as a JSON list of
`{"tool_call_id": ..., "tool_name": ..., "parameters": {...}}`.

- "command_r7b": `<|START_THINKING|>...<|END_THINKING|>` reasoning, then `<|START_ACTION|>[...]<|END_ACTION|>` or
  the answer in `<|START_RESPONSE|>...<|END_RESPONSE|>` (the wrapper is dropped from the content).
- "cohere2moe": the same, the answer in `<|START_TEXT|>...<|END_TEXT|>`; its prompt opens the thought
  (`<|START_THINKING|>`, or an empty one when the template's `reasoning` is off).
- "command_r_plus": `Action:` then a ```` ```json ```` block holding the list (no `tool_call_id`); a reply may start
  with `<|CHATBOT_TOKEN|>` and end with `<|END_OF_TURN_TOKEN|>`, both dropped.

All the `<|...|>` markers are single special tokens of these vocabularies. A call's `tool_call_id` is its id.
Detected by `<|START_ACTION|>` with `<|START_TEXT|>` (Cohere2 MoE) or `<|START_RESPONSE|>` (R7B), and R+ by `Action:`
with `"tool_name"` in its tool prompt.
"""

from __future__ import annotations

from typing import Any

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall
from edgeserve.text.formats.cut_call import tail_cut
from edgeserve.text.formats.markup import (Read, call_list, call_rules, drop_reader, json_list_reader, lit, scan,
                                           skip_space, wrapper_reader)

THINKING = ("<|START_THINKING|>", "<|END_THINKING|>")
ACTION = ("<|START_ACTION|>", "<|END_ACTION|>")
RESPONSE = ("<|START_RESPONSE|>", "<|END_RESPONSE|>")
TEXT = ("<|START_TEXT|>", "<|END_TEXT|>")
CHATBOT, TURN_END = "<|CHATBOT_TOKEN|>", "<|END_OF_TURN_TOKEN|>"
ACTION_WORD, FENCE = "Action:", "```"
TOKENS = (*THINKING, *ACTION, *RESPONSE, *TEXT, CHATBOT, TURN_END)


def _calls(value: Any, ctx: CallContext) -> list[ToolCall] | None:
    return call_list(value, ctx, name_key="tool_name", args_keys=("parameters",), id_key="tool_call_id")


def _read_fenced(text: str, pos: int, ctx: CallContext) -> Read | None:
    """R+'s "Action:" then ```json [...] ``` (the language tag optional)."""
    at = skip_space(text, pos)
    if not text.startswith(FENCE, at):
        return None
    at += len(FENCE)
    return _FENCED(text, at + len("json") if text.startswith("json", at) else at, ctx)


_FENCED = json_list_reader(FENCE, _calls)
_ACTION = json_list_reader(ACTION[1], _calls)
_R7B = {ACTION[0]: _ACTION, RESPONSE[0]: wrapper_reader(RESPONSE[1])}
_MOE = {ACTION[0]: _ACTION, TEXT[0]: wrapper_reader(TEXT[1])}
_PLUS = {ACTION_WORD: _read_fenced, CHATBOT: drop_reader, TURN_END: drop_reader}


def parse_r7b(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a Command R7B reply from its first action or response marker on."""
    return scan(text, _R7B, ctx)


def parse_moe(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a Cohere2 MoE reply from its first action or text marker on."""
    return scan(text, _MOE, ctx)


def parse_plus(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a Command R+ reply from its first `Action:` (or turn marker) on."""
    return scan(text, _PLUS, ctx)


def _list_grammar(tools: list[dict], choice: str | None, parallel: bool, head: str, tail: str) -> str:
    """Lark: `head` + a JSON list of `{"tool_call_id": "N", "tool_name": NAME, "parameters": {...}}` + `tail`."""
    from edgeserve.text.grammar import json_rule

    def call(name: str, args: str) -> str:
        return (f'"{{\\"tool_call_id\\": \\"" /[0-9]{{1,3}}/ "\\", \\"tool_name\\": " {lit(lit(name))} '
                f'", \\"parameters\\": " {args} "}}"')

    items = 'call (",\\n    " call)*' if parallel and choice is None else "call"
    return (f'start: {head} "[\\n    " {items} "\\n]" {tail}\n'
            + call_rules(tools, choice, call, json_rule))


def forced_action(tools: list[dict], choice: str | None, parallel: bool) -> Any:
    """The grammar of a `<|START_ACTION|>[...]<|END_ACTION|>` reply (R7B, Cohere2 MoE)."""
    from edgeserve.text.grammar import GrammarSpec

    return GrammarSpec("lark", _list_grammar(tools, choice, parallel, lit(ACTION[0]), lit(ACTION[1])),
                       tokens=TOKENS)


def forced_plus(tools: list[dict], choice: str | None, parallel: bool) -> Any:
    """The grammar of an `Action:\\n```json\\n[...]\\n```` reply (R+)."""
    from edgeserve.text.grammar import GrammarSpec

    return GrammarSpec("lark", _list_grammar(tools, choice, parallel, lit("Action:\n```json\n"), lit("```")),
                       tokens=TOKENS)


# an action cut short: `<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "NAME", "parameters": {...` so far
ACTION_CUT = tail_cut(r"<\|START_ACTION\|>\s*\[\s*\{\s*(?:\"tool_call_id\"\s*:\s*\"(?P<id>[^\"]*)\"\s*,\s*)?"
                      r"\"tool_name\"\s*:\s*\"(?P<name>[^\"]+)\"\s*,?\s*(?:\"parameters\"\s*:\s*(?P<args>.*))?")


FORMATS = (
    ChatFormat("cohere2moe", lambda s: ACTION[0] in s and TEXT[0] in s, call_markers=(ACTION[0], TEXT[0]),
               parse=parse_moe, reasoning=THINKING, forced=forced_action, thinking_switches=("reasoning",),
               cut=ACTION_CUT,
               priority=20, wraps_answer=True),
    ChatFormat("command_r7b", lambda s: ACTION[0] in s and RESPONSE[0] in s, call_markers=(ACTION[0], RESPONSE[0]),
               parse=parse_r7b, reasoning=THINKING, forced=forced_action, priority=21, wraps_answer=True,
               cut=ACTION_CUT),
    ChatFormat("command_r_plus", lambda s: ACTION_WORD in s and '"tool_name"' in s and ACTION[0] not in s,
               call_markers=(ACTION_WORD, CHATBOT, TURN_END), parse=parse_plus, forced=forced_plus, priority=22, wraps_answer=True),
)
