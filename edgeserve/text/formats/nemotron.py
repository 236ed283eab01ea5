"""NVIDIA Nemotron Nano v2 tool calls: one `<TOOLCALL>` holding a JSON array of `{"name": ..., "arguments":
{...}}` objects, `</TOOLCALL>`. Its prompt opens the thought (`<think>\\n`). (Nemotron 3 Nano writes Qwen3-Coder's
XML calls: the "qwen3_coder" format.)"""

from __future__ import annotations

import json

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall
from edgeserve.text.formats.json_calls import json_call
from edgeserve.text.formats.tag_blocks import Block, call_object_schema, cut_calls
from edgeserve.text.grammar import GrammarSpec, json_rule

OPEN, CLOSE = "<TOOLCALL>", "</TOOLCALL>"
BLOCKS = (Block(OPEN, CLOSE),)


def _read(_: str, body: str) -> list[tuple[str, str, str]] | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    calls = [json_call(item) for item in (value if isinstance(value, list) else [value])]
    return None if not calls or None in calls else calls


def parse_calls(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a Nemotron Nano v2 reply."""
    return cut_calls(text, BLOCKS, _read, ctx)


def forced(tools: list[dict], choice: str | None, parallel: bool) -> GrammarSpec:
    """`<TOOLCALL>` and a JSON array of calls (one call when parallel calls are off or a function is named)."""
    schema = {"type": "array", "items": call_object_schema(tools, choice), "minItems": 1}
    if not parallel or choice is not None:
        schema["maxItems"] = 1
    return GrammarSpec("lark", f'start: "{OPEN}" {json_rule(schema)} "{CLOSE}"\n', tokens=(OPEN, CLOSE))


FORMATS = (
    ChatFormat(name="nemotron_v2", detect=lambda s: OPEN in s, call_markers=(OPEN,), parse=parse_calls, forced=forced,
               priority=20),
)
