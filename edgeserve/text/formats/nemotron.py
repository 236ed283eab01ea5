"""NVIDIA Nemotron Nano v2 tool calls: one `<TOOLCALL>` holding a JSON array of `{"name": ..., "arguments":
{...}}` objects, `</TOOLCALL>`. Its prompt opens the thought (`<think>\\n`). (Nemotron 3 Nano writes Qwen3-Coder's
XML calls: the "qwen3_coder" format.)"""

from __future__ import annotations

import json

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall
from edgeserve.text.formats.tag_blocks import Block, chosen_tools, cut_calls, dumps, parameters
from edgeserve.text.grammar import GrammarSpec, json_rule

OPEN, CLOSE = "<TOOLCALL>", "</TOOLCALL>"
BLOCKS = (Block(OPEN, CLOSE),)


def _read(_: str, body: str) -> list[tuple[str, str, str]] | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    value = value if isinstance(value, list) else [value]
    calls = []
    for item in value:
        args = item.get("arguments", {}) if isinstance(item, dict) else None
        args = json.loads(args) if isinstance(args, str) and args.strip().startswith("{") else args
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not isinstance(args, dict):
            return None
        calls.append((item["name"], dumps(args), ""))
    return calls or None


def parse_calls(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a Nemotron Nano v2 reply."""
    return cut_calls(text, BLOCKS, _read, ctx)


def forced(tools: list[dict], choice: str | None, parallel: bool) -> GrammarSpec:
    """`<TOOLCALL>` and a JSON array of calls (one call when parallel calls are off or a function is named)."""
    items = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               "arguments": parameters(t)[0] or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for t in chosen_tools(tools, choice)]
    schema = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
    if not parallel or choice is not None:
        schema["maxItems"] = 1
    return GrammarSpec("lark", f'start: "{OPEN}" {json_rule(schema)} "{CLOSE}"\n', tokens=(OPEN, CLOSE))


FORMATS = (
    ChatFormat(name="nemotron_v2", detect=lambda s: OPEN in s, call_markers=(OPEN,), parse=parse_calls, forced=forced,
               priority=20),
)
