"""Qwen3-Coder / Qwen3.5 tool calls: XML function blocks read back by the tools' schemas, and their forced-call grammar.

A call in this format (edgeserve.text.formats.qwen3_coder, and others that write the same blocks) is

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

Each VALUE is text (one newline after `<parameter=ARG>` and one before `</parameter>` belong to the markup); it
becomes the type its parameter's schema names: integers, numbers, booleans and null as such, objects and arrays as
JSON (or a Python literal, as the template writes dicts back), anything else, or text that does not read as the
type, stays a string; a union with string takes the other type when the text reads as one. A block closed by
`</function>` is a call even when `</tool_call>` is missing (a reply cut short) or was never written.

With tool_choice "required" or a named function, `forced_call_grammar` constrains the reply to such blocks:
string parameters are free text up to `</parameter>`, the others JSON of their schema, in the schema's property
order, required ones always and optional ones maybe.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any, Callable

FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"
VALUE_END = f"\n{PARAMETER_CLOSE}\n"
CALL_TAGS = ("<tool_call>", "</tool_call>")  # single added tokens in Qwen's vocabularies (GrammarSpec.tokens)

_CALL = re.compile(r"(?:<tool_call>[ \t\r\n]*)?<function=([^>\n]*)>(.*?)</function>[ \t\r\n]*(?:</tool_call>)?",
                   re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


def template_writes_xml_calls(template_source: str) -> bool:
    """Whether a chat template writes tool calls as `<function=...>` blocks with `<parameter=...>` values."""
    return FUNCTION_OPEN in template_source and PARAMETER_OPEN in template_source


# --- reading calls back ---------------------------------------------------------------------------------------


def parse_xml_calls(text: str, schemas: dict[str, dict]) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """(content, [(function name, arguments)]) of a reply: every closed function block whose name is in `schemas`
    (name -> parameters schema) becomes a call, its values typed by that schema; the rest stays content."""
    calls: list[tuple[str, dict[str, Any]]] = []
    kept, last = [], 0
    for m in _CALL.finditer(text):
        name = m.group(1).strip()
        if name not in schemas:
            continue
        calls.append((name, _arguments(m.group(2), schemas[name])))
        kept.append(text[last:m.start()])
        last = m.end()
    content = "".join(kept) + text[last:]
    return (content.strip(), calls) if calls else (text, [])


def _arguments(body: str, schema: dict) -> dict[str, Any]:
    props = schema.get("properties") if isinstance(schema, dict) else None
    props = props if isinstance(props, dict) else {}
    args: dict[str, Any] = {}
    for m in _PARAMETER.finditer(body):
        value = m.group(2)
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        key = m.group(1).strip()
        args[key] = typed_value(value, resolve_ref(props.get(key), schema))
    return args


def resolve_ref(schema: Any, root: dict) -> Any:
    """`schema` with a local `$ref` ("#/$defs/X", "#/definitions/X") into `root` replaced by what it points to
    (its other keys kept); chains of refs are followed a few steps, anything else is returned as it is."""
    for _ in range(8):
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        if not isinstance(ref, str) or not ref.startswith("#/"):
            return schema
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(target, dict) else None
        if not isinstance(target, dict):
            return schema
        schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema


def schema_types(schema: Any) -> list[str]:
    """The JSON types a schema allows, in its order (from `type`, else anyOf / oneOf variants, else enum / const
    values); [] when it names none."""
    if not isinstance(schema, dict):
        return []
    t = schema.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return list(dict.fromkeys(x for v in schema[key] for x in schema_types(v)))
    values = schema.get("enum", [schema["const"]] if "const" in schema else [])
    return list(dict.fromkeys(_json_type(v) for v in values)) if isinstance(values, list) else []


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {dict: "object", list: "array"}.get(type(value), "string")


def typed_value(text: str, schema: Any) -> Any:
    """A parameter's text as the type its schema names: the first of its non-string types the text reads as (so a
    union with string, `["string", "object"]`, still gets a JSON object as an object, as llama.cpp reads it); the
    text itself when it names no type, only strings, or the text reads as none of them."""
    types = schema_types(schema)
    if "null" in types and text.strip().lower() in ("null", "none"):
        return None
    for t in types:
        if t == "string":
            continue
        value = _read(text.strip(), t)
        if value is not _NO:
            return value
    return text


_NO = object()


def _read(text: str, json_type: str) -> Any:
    if json_type == "boolean":
        return {"true": True, "false": False}.get(text.lower(), _NO)
    if json_type in ("integer", "number"):
        try:
            value = json.loads(text)
        except ValueError:
            return _NO
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return _NO
        if json_type == "integer":
            return int(value) if float(value).is_integer() else _NO
        return value
    if json_type in ("object", "array"):
        want = dict if json_type == "object" else list
        for read in (json.loads, ast.literal_eval):
            try:
                value = read(text)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                continue
            if isinstance(value, want):
                return value
    return _NO


# --- forced calls ---------------------------------------------------------------------------------------------


def forced_call_grammar(tools: list[dict], choice: str | None, parallel: bool,
                        json_rule: Callable[[Any], str]) -> str:
    """The Lark grammar (llguidance's dialect) of a reply that is one call of `choice` (or of any of `tools` when
    None; one or more, newline-separated, when `parallel`) in this format. `json_rule`:
    edgeserve.text.grammar.json_rule. The call tags are quoted on their own: give the spec `tokens=CALL_TAGS`."""
    chosen = [t for t in tools if choice is None or t["function"]["name"] == choice]
    start = 'start: call ("\\n" call)*\n' if parallel and choice is None else "start: call\n"
    fns = " | ".join(f"fn_{i}" for i in range(len(chosen)))
    rules = [start, f'call: "{CALL_TAGS[0]}" "\\n" ({fns}) "{CALL_TAGS[1]}"\n']
    for i, tool in enumerate(chosen):
        params = tool["function"].get("parameters")
        params = params if isinstance(params, dict) else {}
        props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
        required = set(params.get("required") or [])
        parts = []
        for j, (key, schema) in enumerate(props.items()):
            value = _value_rule(resolve_ref(schema, params))
            if value is None:  # JSON of its schema (with the root's definitions, for $refs), as a rule of its own
                defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
                rules.append(f"v_{i}_{j}: {json_rule({**schema, **defs})}\n")
                value = f'v_{i}_{j} "\\n{PARAMETER_CLOSE}\\n"'
            rules.append(f"p_{i}_{j}: {json.dumps(f'{PARAMETER_OPEN}{key}>' + chr(10))} {value}\n")
            parts.append(f"p_{i}_{j}" if key in required else f"p_{i}_{j}?")
        if not props:  # no declared properties: any parameters, as text
            parts.append("free_param*")
        head = json.dumps(f"{FUNCTION_OPEN}{tool['function']['name']}>\n")
        rules.append(f'fn_{i}: {head} {" ".join(parts)} "{FUNCTION_CLOSE}\\n"\n')
    rules.append(f'free_param: "{PARAMETER_OPEN}" /[A-Za-z_][A-Za-z0-9_.\\-]*/ ">\\n" text\n')
    # a string value ends at the first newline + </parameter> + newline (a token may end there, not cross it)
    rules.append(f'text[stop={json.dumps(VALUE_END)}]: /(?s:.*)/\n')
    return "".join(rules)


def _value_rule(schema: Any) -> str | None:
    """A string parameter's value with the `VALUE_END` after it: free text, or one of a string enum's values;
    None for a parameter of another type."""
    if schema_types(schema) and "string" not in schema_types(schema):
        return None
    enum = schema.get("enum") if isinstance(schema, dict) else None
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return "(" + " | ".join(json.dumps(v + VALUE_END) for v in enum) + ")"
    return "text"
