"""Pieces the tag-block call formats (DeepSeek, GLM, Kimi, MiniMax, Seed-OSS, Nemotron, muse) share: cutting call blocks out of a reply, typing argument values by the
tool's schema, and the Lark (llguidance) building blocks of their forced-call grammars.

A block of calls becomes calls only when every call in it is well formed and names a known function; otherwise
the whole block stays content, so no text is ever lost.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from edgeserve.text.formats.base import CallContext, ToolCall
from edgeserve.text.grammar import json_rule
from edgeserve.text.xml_tool_calls import resolve_ref, schema_types, typed_value

# (the opener that started the block, the text between it and its closer) -> the block's calls as (name, arguments
# JSON text, id); None: the block is not a call (it stays content)
BlockReader = Callable[[str, str], "list[tuple[str, str, str]] | None"]


@dataclass(frozen=True)
class Block:
    """Call markup that runs from `open` to the first `close` after it; `to_end`: unclosed, it runs to the end of
    the reply (a reply cut short after its last call)."""

    open: str
    close: str
    to_end: bool = False


def cut_calls(text: str, blocks: tuple[Block, ...], read: BlockReader, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls) of `text`: each block that `read` turns into calls to known functions is cut out;
    everything else stays, in order (stripped when calls were found). One pass, `str.find` only: linear in the
    text, however much unclosed markup it holds (a block that is no call is skipped whole)."""
    calls: list[ToolCall] = []
    kept, last, pos = [], 0, 0
    ahead = {b: -1 for b in blocks}  # each kind's next opener at or after pos (searched again once passed)
    while ahead:
        for b, at in list(ahead.items()):
            if at < pos and (at := text.find(b.open, pos)) < 0:
                del ahead[b]  # this kind opens no more blocks
            else:
                ahead[b] = at
        if not ahead:
            break
        block, at = min(ahead.items(), key=lambda item: item[1])
        end = text.find(block.close, at + len(block.open))
        if end < 0 and not block.to_end:
            del ahead[block]  # no closer after this opener, so none after a later one either
            continue
        stop = len(text) if end < 0 else end + len(block.close)
        got = read(block.open, text[at + len(block.open): end if end >= 0 else len(text)])
        if got and all(name in ctx.known for name, _, _ in got):
            calls += [ToolCall(name, args, call_id) for name, args, call_id in got]
            kept.append(text[last:at])
            last = stop
        pos = max(stop, at + 1)
    if not calls:
        return text, []
    return ("".join(kept) + text[last:]).strip(), calls



def section_calls(opener: str, body: str, section: str, call_open: str, call_close: str,
                  read: Callable[[str], "tuple[str, str, str] | None"]) -> list[tuple[str, str, str]] | None:
    """The calls of one call section (or of bare calls, when the block opened with `call_open` itself): each piece
    between `call_open` markers, its `call_close` dropped, read by `read` into (name, arguments, id); None unless
    every piece reads as a call (the block then stays content)."""
    body = body if opener == section else call_open + body
    head, *pieces = body.split(call_open)
    if head.strip() or not pieces:
        return None
    calls = []
    for piece in pieces:
        piece = piece.strip()
        call = read(piece[: -len(call_close)] if piece.endswith(call_close) else piece)
        if call is None:
            return None
        calls.append(call)
    return calls

def consecutive(pattern: re.Pattern, body: str) -> list[re.Match] | None:
    """The matches of `pattern` one after another over all of `body` (each anchored where the last ended; only
    whitespace may follow the last); None when anything else stands between them (the block is then no call)."""
    found, pos = [], 0
    while body[pos:].strip():
        m = pattern.match(body, pos)
        if m is None:
            return None
        found.append(m)
        pos = m.end()
    return found


def invoke_calls(pattern: re.Pattern, body: str,
                 arguments: Callable[[re.Match], "dict | None"]) -> list[tuple[str, str, str]] | None:
    """The calls of a block of consecutive `pattern` matches, one a call (group 1 the function's name),
    `arguments(m)` reading each one's arguments; None unless there is one and every one reads."""
    calls = []
    for m in consecutive(pattern, body) or ():
        args = arguments(m)
        if args is None:
            return None
        calls.append((m.group(1), dumps(args), ""))
    return calls or None


def typed_params(pattern: re.Pattern, body: str, ctx: CallContext, name: str,
                 key: Callable[[str], str] = lambda k: k) -> dict | None:
    """The arguments of a call to `name` written as consecutive `pattern` matches, one a parameter (group 1 its
    key, as `key` cleans it, group 2 its text, typed by the tool's schema); None as `consecutive`."""
    found = consecutive(pattern, body)
    if found is None:
        return None
    args = {}
    for m in found:
        k = key(m.group(1))
        args[k] = typed(m.group(2), param_schema(ctx, name, k))
    return args


def dumps(args: Any) -> str:
    """Arguments as the JSON text a ToolCall carries."""
    return json.dumps(args, ensure_ascii=False)


def json_object_text(text: str) -> str | None:
    """`text` as normalised JSON text when it is one JSON object (whitespace around it allowed), else None."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    return dumps(value) if isinstance(value, dict) else None


def param_schema(ctx: CallContext, name: str, key: str) -> Any:
    """The schema of parameter `key` of function `name` (refs resolved), None when unknown."""
    params = ctx.schemas.get(name) or {}
    props = params.get("properties") if isinstance(params, dict) else None
    return resolve_ref(props.get(key), params) if isinstance(props, dict) else None


def typed(text: str, schema: Any) -> Any:
    """A value written as text, as its schema's type: a union with a string reads as one of its other types when
    the text is one (`{"a": 1}` for ["string", "object"]), else stays text; other schemas as
    edgeserve.text.xml_tool_calls.typed_value reads them; without a schema, JSON when the text is JSON."""
    if schema is None:
        try:
            return json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            return text
    types = schema_types(schema)
    others = [t for t in types if t != "string"]
    if "string" in types and others:
        return typed_value(text, {"type": others})
    return typed_value(text, schema)


def may_be_string(schema: Any) -> bool:
    """Whether a parameter's value is written as raw text (its schema allows strings or names no type)."""
    types = schema_types(schema)
    return not types or "string" in types


# --- forced-call grammars (llguidance's Lark dialect) ---------------------------------------------------------


def lit(text: str) -> str:
    """A Lark string literal (JSON-quoted, as GrammarSpec.tokens expects single-token markup to be written)."""
    return json.dumps(text)


def chosen_tools(tools: list[dict], choice: str | None) -> list[dict]:
    """The tools a forced reply may call: the named one, or all of them under "required"."""
    return [t for t in tools if choice is None or t["function"]["name"] == choice]


def parameters(tool: dict) -> tuple[dict, dict, set[str]]:
    """(parameters schema, properties, required names) of a tool."""
    params = tool["function"].get("parameters")
    params = params if isinstance(params, dict) else {}
    props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    return params, props, set(params.get("required") or [])


def call_object_schema(tools: list[dict], choice: str | None) -> dict:
    """The JSON schema of one `{"name": ..., "arguments": {...}}` call object to one of the chosen tools."""
    items = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               "arguments": parameters(t)[0] or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for t in chosen_tools(tools, choice)]
    return items[0] if len(items) == 1 else {"anyOf": items}


def args_json_rule(tool: dict) -> str:
    """A %json expression for a tool's whole arguments object."""
    params, _, _ = parameters(tool)
    return json_rule(params if params else {"type": "object"})


def value_json_rule(schema: Any, params: dict) -> str:
    """A %json expression for one parameter's value (with the root's definitions, for $refs)."""
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    return json_rule({**schema, **defs} if isinstance(schema, dict) else {})


def string_value(schema: Any, text: str, close: str) -> str:
    """The expression of a string parameter's value up to its closing tag: one of a string enum's values then the
    expression `close`, or else the free-text rule `text` (which includes the closing tag)."""
    enum = schema.get("enum") if isinstance(schema, dict) else None
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return "(" + " | ".join(lit(v) for v in enum) + f") {close}"
    return text


def text_rule(name: str, stop: str) -> str:
    """A rule `name` of free text that ends with (and includes) the text `stop`."""
    return f"{name}[stop={lit(stop)}]: /(?s:.*)/\n"


def lits(text: str, tokens: tuple[str, ...] = ()) -> str:
    """`text` as a sequence of Lark literals, each of `tokens` in it quoted on its own (GrammarSpec.tokens)."""
    if not tokens:
        return lit(text)
    parts = re.split("(" + "|".join(re.escape(t) for t in tokens) + ")", text)
    return " ".join(lit(p) for p in parts if p)


def text_until(name: str, close: str, tokens: tuple[str, ...] = ()) -> str:
    """Rules of `name`: free text, then the closing tag `close` (included), whether `close` (or the parts of it
    in `tokens`) are special tokens of the vocabulary or text. A special token is quoted on its own, for
    GrammarSpec.tokens, and no text regex matches one: free text before it ends where it comes; spelled out as
    text, the tag ends the text at its first occurrence (a stop string spelled so that the token substitution
    leaves it alone). With tokens, text before the first one ends at its first occurrence."""
    tokens = tokens or (close,)
    at = min((i for t in tokens if (i := close.find(t)) >= 0), default=0)
    before, tail = close[:at], lits(close[at:], tokens)
    if before:
        special = f"{name}_s {tail}"
        extra = f"{name}_s[stop={_hidden(before)}]: /(?s:.*)/\n"
    else:
        special, extra = f"{name.upper()}_ANY {tail}", f"{name.upper()}_ANY: /(?s:.*)/\n"
    return f"{name}: {name}_t | {special}\n{name}_t[stop={_hidden(close)}]: /(?s:.*)/\n{extra}"


def _hidden(text: str) -> str:
    """`text` as a Lark string spelled unlike `lit(text)` (its "<" escaped), so GrammarSpec's token substitution
    does not touch it."""
    return json.dumps(text).replace("<", "\\u003c")


def repeat(call_rule: str, parallel: bool, choice: str | None, sep: str = "") -> str:
    """`call_rule` once, or one or more times (separated by the literal `sep`) when parallel calls are allowed
    under "required"."""
    if parallel and choice is None:
        return f"{call_rule} ({lit(sep)} {call_rule})*" if sep else f"{call_rule}+"
    return call_rule


def alternatives(count: int) -> str:
    """The Lark alternation of the call rules `fn_0 | fn_1 | ...` of `count` tools."""
    return " | ".join(f"fn_{i}" for i in range(count))


def tagged_arg(head: Callable[[str], str], close: str,
               after: str = ' "\\n"') -> Callable[[int, int, str, Any, dict], str]:
    """The `keyed_args` expression of a parameter written `head(key)`, its value, the closing tag `close`, then
    `after`: a string value as text (the rule `str_value`, `text_until(..., close)`), any other as JSON of its
    schema."""
    def arg(i: int, j: int, key: str, schema: Any, params: dict) -> str:
        value = f"{value_json_rule(schema, params)} {lit(close)}"
        if may_be_string(schema):
            value = string_value(schema, "str_value", lit(close))
        return f"{head(key)} {value}{after}"
    return arg


def keyed_calls(chosen: list[dict], arg: Callable[[int, int, str, Any, dict], str],
                call: Callable[[dict, str], str]) -> list[str]:
    """The rules of each chosen tool's call: its parameters' rules (`keyed_args` with `arg`) and `fn_I`, the
    expression `call(tool, seq)` around the sequence `seq` of its parameters."""
    rules: list[str] = []
    for i, tool in enumerate(chosen):
        seq, arg_rules = keyed_args(tool, i, arg)
        rules += arg_rules
        rules.append(f"fn_{i}: {call(tool, seq)}\n")
    return rules


def keyed_args(tool: dict, i: int, arg: Callable[[int, int, str, Any, dict], str]) -> tuple[str, list[str]]:
    """A tool's arguments as tag-per-parameter markup: (the sequence expression, its rules). `arg(i, j, key,
    schema, params)` gives the expression of parameter j (its own separators included); required parameters come
    always and optional ones maybe, in the schema's order."""
    params, props, required = parameters(tool)
    parts: list[str] = []
    rules: list[str] = []
    for j, (key, schema) in enumerate(props.items()):
        rules.append(f"a_{i}_{j}: {arg(i, j, key, resolve_ref(schema, params), params)}\n")
        parts.append(f"a_{i}_{j}" if key in required else f"a_{i}_{j}?")
    return " ".join(parts), rules
