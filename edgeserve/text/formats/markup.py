"""Shared pieces of the formats whose calls sit behind a marker: scanning a reply for markers and reading what
follows each one, JSON values and call objects inside that text, and the Lark rules of a forced call.

A format supplies `Reader`s, one per marker: given the text and the position right after the marker, a reader
returns what it read (`Read`: calls, the text it stands for in the content, where it ended) or None when what
follows is not its syntax (the marker then stays content). `scan` runs them over a reply.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from edgeserve.text.formats.base import CallContext, ToolCall

_DECODER = json.JSONDecoder()
_SPACE = " \t\r\n"


@dataclass
class Read:
    """What a reader took from a reply: `calls`, the `content` that stands in for the markup (the text of a
    wrapper such as `<response>...</response>`; '' for calls) and `end`, the position after the markup."""

    calls: list[ToolCall]
    content: str
    end: int


Reader = Callable[[str, int, CallContext], "Read | None"]


def scan(text: str, readers: dict[str, Reader], ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls) of `text`: at each marker (the earliest first) its reader reads on; what no reader took
    stays content, in order (stripped of the whitespace at its ends when there were calls); a reply where nothing
    was read is returned as it is."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = last = 0
    took = False
    while True:
        found = [(at, m) for m in readers if m and (at := text.find(m, pos)) >= 0]
        if not found:
            break
        at, marker = min(found, key=lambda f: (f[0], -len(f[1])))
        read = readers[marker](text, at + len(marker), ctx)
        if read is None:
            pos = at + len(marker)
            continue
        kept += [text[last:at], read.content]
        calls.extend(read.calls)
        took, pos = True, read.end
        last = pos
    if not took:
        return text, []
    kept.append(text[last:])
    content = "".join(kept)
    return (content.strip(_SPACE) if calls else content), calls


def json_list_reader(close: str = "", read_calls: Callable[[Any, CallContext], "list[ToolCall] | None"] | None = None,
                     lists_only: bool = True) -> Reader:
    """A reader of a JSON list of calls (one object too, unless `lists_only`) right after its marker, then
    `close` (which may be missing: a reply cut short). `read_calls`: the calls of the JSON value (default
    `call_list`, `{"name", "arguments"}` items)."""
    def read(text: str, pos: int, ctx: CallContext) -> Read | None:
        value = json_at(text, pos)
        if value is None or (lists_only and not isinstance(value[0], list)):
            return None
        calls = (read_calls or call_list)(value[0], ctx)
        if not calls:
            return None
        end = skip_space(text, value[1])
        return Read(calls, "", end + len(close) if close and text.startswith(close, end) else value[1])
    return read


def wrapper_reader(close: str) -> Reader:
    """A reader of an answer wrapper (`<response>...</response>`): its text up to `close` (or the end) is content,
    the markup is dropped."""
    def read(text: str, pos: int, ctx: CallContext) -> Read:
        end = text.find(close, pos)
        end = len(text) if end < 0 else end
        return Read([], text[pos:end], min(len(text), end + len(close)))
    return read


def drop_reader(text: str, pos: int, ctx: CallContext) -> Read:
    """A reader that drops its marker (turn markup a model may write around its answer)."""
    return Read([], "", pos)


def skip_space(text: str, pos: int) -> int:
    """The first position at or after `pos` that is not whitespace."""
    while pos < len(text) and text[pos] in _SPACE:
        pos += 1
    return pos


def json_at(text: str, pos: int) -> tuple[Any, int] | None:
    """(the JSON value starting at `pos`, after leading whitespace; the position after it), or None."""
    try:
        return _DECODER.raw_decode(text, skip_space(text, pos))
    except json.JSONDecodeError:
        return None


def arguments_json(value: Any) -> str | None:
    """A call's arguments as JSON text: an object as it is, a string holding an object read first; None for
    anything else."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def call_list(value: Any, ctx: CallContext, name_key: str = "name",
              args_keys: tuple[str, ...] = ("arguments", "parameters"), id_key: str = "id") -> list[ToolCall] | None:
    """The calls of a JSON list (or one object) of `{name_key: NAME, args_key: {...}}` items, all to known
    functions; None if any item is not such a call."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        call = call_object(item, ctx, name_key, args_keys, id_key)
        if call is None:
            return None
        calls.append(call)
    return calls or None


def call_object(item: Any, ctx: CallContext, name_key: str = "name",
                args_keys: tuple[str, ...] = ("arguments", "parameters"), id_key: str = "id") -> ToolCall | None:
    """One `{name_key: NAME, args_key: {...}}` object as a call to a known function, or None."""
    if not isinstance(item, dict) or item.get(name_key) not in ctx.known:
        return None
    args = next((item[k] for k in args_keys if k in item), {})
    text = arguments_json(args)
    if text is None:
        return None
    call_id = item.get(id_key)
    return ToolCall(item[name_key], text, str(call_id) if isinstance(call_id, (str, int)) else "")


# --- forced calls ---------------------------------------------------------------------------------------------


def parameters(tool: dict) -> dict:
    """A tool's parameters schema (an empty object schema when it has none)."""
    params = tool.get("function", {}).get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object", "properties": {}}


def chosen_tools(tools: list[dict], choice: str | None) -> list[dict]:
    """The tools a forced reply may call: the one named `choice`, or all (choice None); ValueError when the
    name is not among them."""
    chosen = [t for t in tools if choice is None or t.get("function", {}).get("name") == choice]
    if not chosen:
        raise ValueError(f"tool_choice names {choice!r}, which is not among the tools")
    return chosen


def call_rules(tools: list[dict], choice: str | None, call: Callable[[str, str], str],
               json_rule: Callable[[Any], str]) -> str:
    """Lark rules: `call` (one call of any chosen tool), `fn_i` per tool as `call(name, args_rule)` (the name as
    a Python string, the rule of its arguments' JSON) and `args_i` the JSON of its parameters."""
    rules, alts = [], []
    for i, tool in enumerate(chosen_tools(tools, choice)):
        rules.append(f"args_{i}: {json_rule(parameters(tool))}\n")
        rules.append(f"fn_{i}: {call(tool['function']['name'], f'args_{i}')}\n")
        alts.append(f"fn_{i}")
    return f"call: {' | '.join(alts)}\n" + "".join(rules)


def lit(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text)


def object_call(name: str, args: str, name_key: str = "name", args_key: str = "arguments") -> str:
    """Lark for the JSON object `{"name": NAME, "arguments": <args rule>}` (the compact spacing the grammars
    here use)."""
    head = "{" + json.dumps(name_key) + ": " + json.dumps(name) + ", " + json.dumps(args_key) + ": "
    return f"{lit(head)} {args} {lit('}')}"


def list_grammar(head: str, parallel: bool, call_rules_text: str, tail: str = "") -> str:
    """Lark `start: head "[" call (", " call)* "]" tail` (one call unless `parallel`) with `call_rules_text`.
    head and tail are Lark expressions ('' for none)."""
    items = 'call (", " call)*' if parallel else "call"
    return f'start: {head} "[" {items} "]" {tail}\n'.replace("start:  ", "start: ") + call_rules_text
