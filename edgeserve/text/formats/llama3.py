"""Llama 3.1 / 3.2 / 3.3's JSON calls: the reply is the call, a bare JSON object `{"name": ..., "parameters":
{...}}` (or after `<|python_tag|>`), several separated by `;`. Detected by `<|python_tag|>`, or by the `ipython`
role in a template that renders tools. Forced calls are such objects (`; `-separated when parallel), without the
python tag (llama.cpp keeps it for the built-in tools)."""

from __future__ import annotations

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall
from edgeserve.text.formats.json_calls import calls_from_json, json_values
from edgeserve.text.formats.markup import call_rules, calls_rule, object_call
from edgeserve.text.grammar import GrammarSpec, json_rule
from edgeserve.text.partial_calls import cut_call_objects

PYTHON_TAG = "<|python_tag|>"
JSON_START = '{"name"'


def detect(source: str) -> bool:
    """Whether a template is Llama 3's (python tag, or the ipython role with tools)."""
    return PYTHON_TAG in source or ("ipython" in source and "tools" in source)


def parse(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls): the JSON objects at the start of the text (after an optional python tag) when they are
    wholly calls of offered functions; text after them stays content."""
    body = text.lstrip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):]
    if not body.lstrip().startswith("{"):
        return text, []
    values, end = json_values(body)
    calls = calls_from_json(values, ctx)
    if not calls:
        return text, []
    return body[end:].strip(), calls


def forced(tools: list[dict], choice: str | None, parallel: bool) -> GrammarSpec:
    """The grammar of a reply that is `{"name": ..., "parameters": {...}}` calls (one unless `parallel`),
    parameters by each tool's schema."""
    def call(name: str, args: str) -> str:
        return object_call(name, args, args_key="parameters")

    start = f'start: {calls_rule("call", parallel and choice is None, "; ")}\n'
    return GrammarSpec("lark", start + call_rules(tools, choice, call, json_rule))


def cut(text: str, ctx: CallContext) -> list[ToolCall]:
    """The calls of a forced reply cut short: the complete objects, then the cut one as far as it got."""
    body = text.lstrip()
    return cut_call_objects(body.removeprefix(PYTHON_TAG), 0, ctx)


FORMATS = (ChatFormat("llama3", detect=detect, call_markers=(PYTHON_TAG, JSON_START), parse=parse,
                      forced=forced, cut=cut, priority=850),)
