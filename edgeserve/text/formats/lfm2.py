"""LFM2 / LFM2.5 (Liquid AI): pythonic tool calls.

A reply's calls are one Python-style list between two added tokens,

    <|tool_call_start|>[get_time(city="Paris"), Calendar.create_event(title='demo', when=None)]<|tool_call_end|>

names maybe dotted, arguments by keyword only, values Python literals (strings in either quotes, True / False /
None, numbers, lists, dicts; the JSON spellings true / false / null too, as the models also write them). Each
value is read with `ast.literal_eval` (never evaluated as code) and returned as JSON. A block is read whole: when
one of its calls is malformed or names a function the request did not offer, the block stays text. A block whose
list is complete still counts when `<|tool_call_end|>` never came (a reply cut right there).

LFM2.5-8B-A1B thinks in `<think>...</think>` before the answer (the generic rule). Detected by the tool list the
templates write into the system prompt (`<|tool_list_start|>` in LFM2's, `List of tools: [` in LFM2.5's) or by
the call token itself. Forced calls (`forced`) are a grammar of this syntax: the tools' keyword arguments in
their schema's order, string values in either quotes, booleans and None as Python writes them, other values JSON
of their schema. LFM2's and LFM2.5-Instruct's templates never render an assistant message's `tool_calls`: such
calls go into the message's content in this syntax (`history_calls`), so a conversation with tool results shows
the model its own calls.
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall
from edgeserve.text.formats.cut_call import pythonic_arguments, tail_cut
from edgeserve.text.formats.markup import separated
from edgeserve.text.grammar import GrammarSpec, json_rule
from edgeserve.text.xml_tool_calls import resolve_ref

CALL_START, CALL_END = "<|tool_call_start|>", "<|tool_call_end|>"
TOOL_LIST_START = "<|tool_list_start|>"
TOOL_LIST_PLAIN = "List of tools: ["  # LFM2.5's templates list the tools without the special tokens


def writes_lfm2(template_source: str) -> bool:
    """Whether a chat template is one of Liquid AI's LFM2 / LFM2.5 templates."""
    return any(m in template_source for m in (TOOL_LIST_START, TOOL_LIST_PLAIN, CALL_START))


# --- reading calls ---------------------------------------------------------------------------------------------

_NAME = re.compile(r"\s*([A-Za-z_][\w\-]*(?:\.[A-Za-z_][\w\-]*)*)\s*\(")
_KEY = re.compile(r"\s*([A-Za-z_]\w*)\s*=(?!=)")
_WS = re.compile(r"\s*")
_OPEN, _CLOSE = "([{", ")]}"


def parse_calls(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content left over, calls) of reply text from the first `<|tool_call_start|>` on; every call block whose
    calls all read and name functions in `ctx.known` becomes calls, anything else stays content, in order."""
    kept: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while (at := text.find(CALL_START, pos)) >= 0:
        kept.append(text[pos:at])
        end = text.find(CALL_END, at)
        body_end, pos = (end, end + len(CALL_END)) if end >= 0 else (len(text), len(text))
        found = read_call_list(text[at + len(CALL_START):body_end])
        if found is not None and all(call.name in ctx.known for call in found):
            calls += found
        else:
            kept.append(text[at:pos])
    kept.append(text[pos:])
    content = "".join(kept)
    return (content.strip(), calls) if calls else (text, [])


def read_call_list(body: str) -> list[ToolCall] | None:
    """The calls of `[fn(k=v, ...), ...]` (the brackets may be left out), or None when `body` is not such a list
    in full (a positional argument, a value that is not a literal, text after it, no call at all)."""
    pos = _WS.match(body).end()
    bracket = body.startswith("[", pos)
    pos += int(bracket)
    calls: list[ToolCall] = []
    while (m := _NAME.match(body, pos)) is not None:
        args, pos = _read_arguments(body, m.end())
        if args is None:
            return None
        try:
            arguments = to_json(args)
            arguments.encode("utf-8")  # a lone surrogate from a \ud800 escape is no text an API can send
        except (TypeError, ValueError, UnicodeEncodeError):  # a set, bytes, a complex number ...
            return None
        calls.append(ToolCall(m.group(1), arguments))
        pos = _WS.match(body, pos).end()
        if not body.startswith(",", pos):
            break
        pos += 1
    pos = _WS.match(body, pos).end()
    if bracket:
        if not body.startswith("]", pos):
            return None
        pos = _WS.match(body, pos + 1).end()
    return calls if calls and pos == len(body) else None


def _read_arguments(body: str, pos: int) -> tuple[dict[str, Any] | None, int]:
    """The keyword arguments after a call's `(` up to its `)`: (arguments, position after the `)`), or None."""
    args: dict[str, Any] = {}
    while True:
        pos = _WS.match(body, pos).end()
        if body.startswith(")", pos):
            return args, pos + 1
        m = _KEY.match(body, pos)
        end = _value_end(body, m.end()) if m is not None else -1
        if end < 0:
            return None, pos
        try:
            args[m.group(1)] = literal(body[m.end():end])
        except ValueError:
            return None, pos
        pos = end + body.startswith(",", end)


def _value_end(text: str, pos: int) -> int:
    """Where the Python expression starting at `pos` ends: the `,` or `)` after it outside any bracket or string;
    -1 when the text ends first or the brackets do not match."""
    depth: list[str] = []
    while pos < len(text):
        ch = text[pos]
        if ch in "\"'":
            pos = _string_end(text, pos)
            if pos < 0:
                return -1
            continue
        if ch in _OPEN:
            depth.append(_CLOSE[_OPEN.index(ch)])
        elif ch in _CLOSE:
            if not depth:
                return pos if ch == ")" else -1
            if depth.pop() != ch:
                return -1
        elif ch == "," and not depth:
            return pos
        pos += 1
    return -1


def _string_end(text: str, pos: int) -> int:
    """The position after the string literal opening at `pos` (single, double or triple quotes), or -1."""
    quote = text[pos] * 3 if text.startswith(text[pos] * 3, pos) else text[pos]
    pos += len(quote)
    while pos < len(text):
        if text[pos] == "\\":
            pos += 2
        elif text.startswith(quote, pos):
            return pos + len(quote)
        elif text[pos] == "\n" and len(quote) == 1:
            return -1
        else:
            pos += 1
    return -1


def to_json(value: Any) -> str:
    """A literal's value as JSON text (json.dumps' spacing; tuples as arrays, integer keys as strings; a float
    beyond a double's range, which Python reads as infinity, as the number 1e999 or -1e999: JSON has no infinity);
    TypeError for what JSON cannot hold."""
    if isinstance(value, float) and math.isinf(value):
        return "1e999" if value > 0 else "-1e999"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(to_json, value)) + "]"
    if isinstance(value, dict):
        if not all(isinstance(k, str) or type(k) is int for k in value):
            raise TypeError("a dict key that is neither a string nor an integer")
        items = (f"{json.dumps(str(k), ensure_ascii=False)}: {to_json(v)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    if value is None or isinstance(value, (str, int, float)):
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    raise TypeError(f"no JSON for a {type(value).__name__}")


class _JsonNames(ast.NodeTransformer):
    """true / false / null, as the models also write them, as the constants they mean."""

    NAMES = {"true": True, "false": False, "null": None}

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in self.NAMES:
            return ast.copy_location(ast.Constant(self.NAMES[node.id]), node)
        return node


def literal(text: str) -> Any:
    """The value of a Python literal (JSON's true / false / null accepted), by `ast.literal_eval`: never run as
    code. ValueError when the text is not a literal."""
    try:
        # Python's parser refuses a NUL byte even inside a string: there it means the character, as \x00 does
        tree = _JsonNames().visit(ast.parse(text.strip().replace("\0", "\\x00"), mode="eval"))
        return ast.literal_eval(tree)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as e:
        raise ValueError(f"not a literal: {text[:80]!r}") from e


# --- writing calls ---------------------------------------------------------------------------------------------


def write_calls(calls: list[dict]) -> str:
    """OpenAI-style calls (arguments as objects) as the models write them: one block
    `<|tool_call_start|>[name(key=value, ...), ...]<|tool_call_end|>`, strings in double quotes, True / False / None
    as Python spells them, lists and objects as JSON (as LFM2.5's own template writes them)."""
    written = []
    for call in calls:
        fn = call.get("function", {})
        args = fn.get("arguments") or {}
        written.append(f"{fn.get('name')}(" + ", ".join(f"{k}={_python_value(v)}" for k, v in args.items()) + ")")
    return f"{CALL_START}[{', '.join(written)}]{CALL_END}"


def _python_value(value: Any) -> str:
    if value is True or value is False or value is None:
        return repr(value)
    return json.dumps(value, ensure_ascii=False)


# --- forced calls ----------------------------------------------------------------------------------------------

# a Python string in double or single quotes: the escapes Python reads (no \N{...}, no lone surrogate), no line
# break inside
_ESCAPE = r"""\\(?:["'\\abfnrtv0]|x[0-9a-fA-F]{2}|u(?:[0-9a-ce-fA-CE-F][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}))"""
_PY_STRING = (r"""PY_STRING: /"(?:[^"\\\n\r]|ESC)*"/ | /'(?:[^'\\\n\r]|ESC)*'/""" + "\n").replace("ESC", _ESCAPE)
_FREE_KEY = "FREE_KEY: /[A-Za-z_][A-Za-z0-9_]*/\n"
_PLAIN_KEYS = {"type", "description", "title", "default", "examples", "nullable"}  # no constraint beyond the type
# the simple types' values as the models write them (None: JSON of the type)
_SIMPLE = {"string": "PY_STRING", "boolean": '"True" | "False" | "true" | "false"', "null": '"None" | "null"',
           "integer": None, "number": None}


def forced_grammar(tools: list[dict], choice: str | None, parallel: bool) -> GrammarSpec:
    """The grammar (llguidance's Lark dialect) of a reply that is one call block of `choice` (or of any of
    `tools` when None; one or more calls in the list when `parallel` and no choice), arguments by the tools'
    schemas."""
    chosen = [t for t in tools if choice is None or t["function"]["name"] == choice]
    calls = 'call (", " call)*' if parallel and choice is None else "call"
    rules = [f'start: "{CALL_START}" "[" {calls} "]" "{CALL_END}"\n',
             "call: " + " | ".join(f"fn_{i}" for i in range(len(chosen))) + "\n"]
    for i, tool in enumerate(chosen):
        rules += _function_rules(i, tool)
    rules += [_PY_STRING, _FREE_KEY]
    return GrammarSpec("lark", "".join(rules), tokens=(CALL_START, CALL_END))


def _function_rules(i: int, tool: dict) -> list[str]:
    """`fn_i: "NAME(" arguments ")"` and the rules of its arguments."""
    params = tool["function"].get("parameters")
    params = params if isinstance(params, dict) else {}
    props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    required = set(params.get("required") or [])
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    rules, items = [], []
    for j, (key, schema) in enumerate(props.items()):
        rules.append(f"arg_{i}_{j}: {json.dumps(key + '=')} {_value_rule(resolve_ref(schema, params), defs)}\n")
        items.append((f"arg_{i}_{j}", key in required))
    head = json.dumps(tool["function"]["name"] + "(")
    if not props:  # no declared properties: any keyword arguments, each a JSON value
        rules.append(f'free_{i}: FREE_KEY "=" {json_rule({})}\n')
        return rules + [f'fn_{i}: {head} (free_{i} (", " free_{i})*)? ")"\n']
    return rules + [f'fn_{i}: {head} {separated(items, ", ")} ")"\n']


def _value_rule(schema: Any, defs: dict) -> str:
    """A value of `schema` as the models write it: for a schema that only names simple types, a string in either
    quotes, a boolean as True / False (or JSON's), null as None (or null), a number as JSON writes it; anything
    else JSON of the schema (a Python literal too)."""
    if isinstance(schema, dict) and set(schema) <= _PLAIN_KEYS:
        kind = schema.get("type")
        kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []
        kinds += ["null"] if schema.get("nullable") is True else []
        if kinds and all(k in _SIMPLE for k in kinds):
            rules = [_SIMPLE[k] or json_rule({"type": k}) for k in dict.fromkeys(kinds)]
            return "(" + " | ".join(rules) + ")"
    return json_rule({**schema, **defs} if isinstance(schema, dict) else {})


FORMATS = (
    ChatFormat(
        name="lfm2",
        detect=writes_lfm2,
        call_markers=(CALL_START,),
        parse=parse_calls,
        forced=forced_grammar,
        history_calls=write_calls,
        priority=50,
        cut=tail_cut(r"<\|tool_call_start\|>\s*\[\s*(?P<name>[A-Za-z_][\w\-.]*)\((?P<args>[^()]*)",
                     pythonic_arguments),
    ),
)
