"""Shared pieces of the formats whose calls sit behind a marker: scanning a reply for markers and reading what
follows each one, JSON values and call objects inside that text, and the Lark rules of a forced call.

A format supplies `Reader`s, one per marker: given the text and the position right after the marker, a reader
returns what it read (`Read`: calls, the text it stands for in the content, where it ended) or None when what
follows is not its syntax (the marker then stays content). `scan` runs them over a reply.
"""

from __future__ import annotations

import json
import re
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

# Calls one forced reply may make under tool_choice "required" with parallel_tool_calls true (one without it): a
# random-weights or looping model must not emit calls until max_tokens.
MAX_PARALLEL_CALLS = 16


def calls_rule(call: str, parallel: bool, sep: str = "") -> str:
    """Lark for `call` once, or (`parallel`) one to MAX_PARALLEL_CALLS times separated by the literal `sep`."""
    if not parallel:
        return call
    return f"{call} ({lit(sep)} {call}){{0,{MAX_PARALLEL_CALLS - 1}}}" if sep else f"{call}{{1,{MAX_PARALLEL_CALLS}}}"


def separated(items: list[tuple[str, bool]], sep: str) -> str:
    """Lark for rules written in order with the literal `sep` between them, each (rule, required) present always
    or maybe: one alternative for each rule that can come first. '' for no items."""
    def tail(k: int) -> str:
        return " ".join(f"{lit(sep)} {rule}" if req else f"({lit(sep)} {rule})?" for rule, req in items[k:])

    firsts = []
    for k, (rule, req) in enumerate(items):
        firsts.append(f"({rule} {tail(k + 1)})".replace(" )", ")"))
        if req:
            return "(" + " | ".join(firsts) + ")"
    return "(" + " | ".join(firsts) + ")?" if firsts else ""


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


def block_reader(item_open: str, item: Reader, close: str) -> Reader:
    """A reader of a block of calls after its marker: one or more `item_open` + what `item` reads (whitespace
    between them), then `close` (may be missing). None when no call was read."""
    def read(text: str, pos: int, ctx: CallContext) -> Read | None:
        calls: list[ToolCall] = []
        at = skip_space(text, pos)
        while text.startswith(item_open, at):
            one = item(text, at + len(item_open), ctx)
            if one is None:
                return None
            calls += one.calls
            at = skip_space(text, one.end)
        if not calls:
            return None
        return Read(calls, "", at + len(close) if close and text.startswith(close, at) else at)
    return read


def free_text(close: str, name: str = "free") -> str:
    """Lark rules: `name` is free text and then `close`, whether `close` is text or one special token of the
    vocabulary (listed in GrammarSpec.tokens, which turns its quoted literal into the token): text ends at the
    first `close` (llguidance's stop=, its string escaped so that it stays text), or a lexeme that cannot hold
    `close` is followed by the token."""
    escaped = '"' + f"\\u{ord(close[0]):04x}" + json.dumps(close)[2:]
    inner = re.escape(close).replace("/", "\\/")
    lexeme = name.upper()
    return (f"{name}: {lexeme} {lit(close)} | {name}_stop\n"
            f"{name}_stop[stop={escaped}]: /(?s:.*)/\n"
            f"{lexeme}: /(?s:.*)/ & ~/(?s:.*{inner}.*)/\n")


def value_rule(schema: Any, close: str, json_rule: Callable[[Any], str], text_rule: str = "free") -> str:
    """Lark for a parameter's value written as text and then `close`: one of a string enum's values, free text
    (`text_rule`, see `free_text`) for a string, JSON of its schema otherwise."""
    from edgeserve.text.xml_tool_calls import schema_types

    enum = schema.get("enum") if isinstance(schema, dict) else None
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return "(" + " | ".join(lit(v) for v in enum) + f") {lit(close)}"
    types = schema_types(schema)
    return text_rule if not types or "string" in types else f"{json_rule(schema)} {lit(close)}"


def param_sequence(params: dict, head: Callable[[str], str], close: str, tail: str, json_rule: Callable[[Any], str],
                   rules: list[str]) -> str:
    """Lark for a function's parameters written one by one as `head(key)` VALUE `close` `tail`, in the schema's
    property order, required ones always and the others maybe (VALUE: `value_rule`). Each parameter's rule is
    appended to `rules`; returns the sequence of their names."""
    from edgeserve.text.xml_tool_calls import resolve_ref

    props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    required = set(params.get("required") or [])
    parts = []
    for key, prop in props.items():
        name = f"p_{len(rules)}"
        rules.append(f"{name}: {head(key)} {value_rule(resolve_ref(prop, params), close, json_rule)} {tail}\n")
        parts.append(name if key in required else f"{name}?")
    return " ".join(parts)
