"""Calls written as JSON objects (`{"name": ..., "arguments": {...}}`): reading them out of reply text, for the
formats that write them (hermes, mistral, llama3 and others). Not a format itself (it is not in MODULES)."""

from __future__ import annotations

import json
from typing import Any

from edgeserve.text.formats.base import CallContext, ToolCall


def arguments_object(args: Any) -> Any:
    """Arguments as a value: JSON text parsed (left as it is when it does not parse), anything else unchanged."""
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return args


def json_values(text: str, start: int = 0) -> tuple[list[Any], int]:
    """Consecutive JSON values in `text` from `start` (separated by whitespace, commas or semicolons), and where
    the last one ends; stops at the first thing that is not JSON."""
    decoder, values, i, end = json.JSONDecoder(), [], start, start
    while i < len(text):
        while i < len(text) and text[i] in " \t\r\n,;":
            i += 1
        if i >= len(text):
            break
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        values.append(value)
        end = i
    return values, end


def json_call(obj: Any) -> tuple[str, str, str] | None:
    """(name, arguments JSON text, "") of a `{"name": ..., "arguments": {...}}` object (its arguments an object or
    JSON text of one; none: {}), None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = arguments_object(obj.get("arguments", {}))
    return (obj["name"], json.dumps(args, ensure_ascii=False), "") if isinstance(args, dict) else None


def call_from_json(obj: Any, ctx: CallContext, args_keys: tuple[str, ...] = ("arguments", "parameters"),
                   name_key: str = "name") -> ToolCall | None:
    """The call an object describes, or None: its name must be a function the request offered and its arguments
    (the first of `args_keys` present, an object or JSON text of one; none: {}) an object. An `id` the model
    wrote (Mistral's) is the call's id."""
    if not isinstance(obj, dict) or not isinstance(obj.get(name_key), str) or obj[name_key] not in ctx.known:
        return None
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = arguments_object(obj[key])
            break
    if not isinstance(args, dict):
        return None
    call_id = obj.get("id") if isinstance(obj.get("id"), str) else ""
    return ToolCall(obj[name_key], json.dumps(args, ensure_ascii=False), call_id)


def calls_from_json(values: list[Any], ctx: CallContext) -> list[ToolCall] | None:
    """Every value (or item of a list value) as a call; None when any of them is not a valid call (the text they
    came from then stays content: nothing is dropped)."""
    flat = [x for v in values for x in (v if isinstance(v, list) else [v])]
    calls = [call_from_json(v, ctx) for v in flat]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]
