"""Llama 3.1 / 3.2 / 3.3's JSON calls: the reply is the call, a bare JSON object `{"name": ..., "parameters":
{...}}` (or after `<|python_tag|>`), several separated by `;`. Detected by `<|python_tag|>`, or by the `ipython`
role in a template that renders tools."""

from __future__ import annotations

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall
from edgeserve.text.formats.json_calls import calls_from_json, json_values

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


FORMATS = (ChatFormat("llama3", detect=detect, call_markers=(PYTHON_TAG, JSON_START), parse=parse,
                      priority=850),)
