"""Gemma 4's call arguments as a Lark grammar (llguidance's dialect) built from a JSON schema: objects with bare
keys (`{city:<|"|>Paris<|"|>,n:5}`, keys in sorted order as the template writes them), strings between `<|"|>`
delimiters, numbers, booleans and null as JSON writes them, arrays in brackets. Not a format itself (it is not in
MODULES): edgeserve.text.formats.gemma4 uses it for forced calls.

`<|"|>` is one special token of Gemma 4's vocabulary, which no text regex can match; the grammar quotes it on its
own (GrammarSpec.tokens turns that into the token), so a string's text is a lexeme that cannot hold the delimiter,
followed by the delimiter. Where the vocabulary spells the delimiter as text, the text and its closing delimiter
are one lexeme instead (llguidance's stop= cannot end a constrained regex at a multi-byte text). Strings keep their
schema's enum / const, minLength / maxLength and pattern; numbers their bounds (JSON's own rules for them).
"""

from __future__ import annotations

import json
import re
from typing import Any

from edgeserve.text.formats.tag_blocks import lits
from edgeserve.text.grammar import json_rule
from edgeserve.text.xml_tool_calls import resolve_ref

QUOTE = '<|"|>'
# a key the parser reads bare (edgeserve.text.formats.gemma4._BARE_KEY); other keys are written as strings
_BARE = re.compile(r"[A-Za-z_][\w\-]*")
_NO_QUOTE = r'~/(?s:.*<\|"\|>.*)/'
_ENDS_AT_QUOTE = r'~/(?s:.*<\|"\|>.+)/'
_SCALAR = {"integer", "number", "boolean", "null"}  # written as JSON writes them
_MAX_DEPTH = 12  # schemas nested deeper (or recursive without $ref) get the generic value

# any value, for a schema that does not say (and an object's undeclared members)
GENERIC = (
    'g_value: g_string | g_dict | g_array | G_NUMBER | "true" | "false" | "null"\n'
    f"g_string: {json.dumps(QUOTE)} g_text\n"
    f"g_text: GTEXT {json.dumps(QUOTE)} | GTEXT_Q\n"
    f"GTEXT: /(?s:.*)/ & {_NO_QUOTE}\n"
    f'GTEXT_Q: /(?s:.*)<\\|"\\|>/ & {_ENDS_AT_QUOTE}\n'
    'g_dict: "{" (g_kv ("," g_kv)*)? "}"\n'
    'g_kv: (G_KEY | g_string) ":" g_value\n'
    "G_KEY: /[A-Za-z_][A-Za-z0-9_\\-]*/\n"
    'g_array: "[" (g_value ("," g_value)*)? "]"\n'
    "G_NUMBER: /-?(?:0|[1-9][0-9]*)(?:\\.[0-9]+)?(?:[eE][+-]?[0-9]+)?/\n"
)


def gemma_text(value: Any) -> str:
    """A JSON value as Gemma 4's template writes an argument (format_argument, keys bare and sorted)."""
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "{" + ",".join(f"{_key_text(k)}:{gemma_text(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, list):
        return "[" + ",".join(gemma_text(v) for v in value) + "]"
    return json.dumps(value)


def _key_text(key: str) -> str:
    return key if _BARE.fullmatch(key) else QUOTE + key + QUOTE


class ArgumentRules:
    """Builds the Lark rules of values of JSON schemas in Gemma 4's syntax; `rules` collects them, named after
    `prefix` (one per tool). They refer to the `GENERIC` rules, which the grammar adds once."""

    def __init__(self, root: dict, prefix: str) -> None:
        self.root = root  # the parameters schema: where $refs point
        self.prefix = prefix
        self.rules: list[str] = []
        self._refs: dict[str, str] = {}

    def value(self, schema: Any, depth: int = 0) -> str:
        """A Lark expression of a value of `schema`."""
        if depth > _MAX_DEPTH or not isinstance(schema, dict) or not schema:
            return "g_value"
        ref = schema.get("$ref")
        if isinstance(ref, str) and set(schema) == {"$ref"}:
            return self._named_ref(ref, depth)
        schema = resolve_ref(schema, self.root)
        if "const" in schema:
            return lits(gemma_text(schema["const"]), (QUOTE,))
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return "(" + " | ".join(lits(gemma_text(v), (QUOTE,)) for v in schema["enum"]) + ")"
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                rest = {k: v for k, v in schema.items() if k != key}
                return "(" + " | ".join(self.value({**rest, **resolve_ref(s, self.root)}, depth + 1)
                                        for s in schema[key] if isinstance(s, dict)) + ")"
        if isinstance(schema.get("allOf"), list):
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for part in schema["allOf"]:
                merged.update(resolve_ref(part, self.root) if isinstance(part, dict) else {})
            return self.value(merged, depth + 1)
        kind = schema.get("type")
        if isinstance(kind, list):
            return "(" + " | ".join(self.value({**schema, "type": t}, depth + 1) for t in kind) + ")"
        if kind is None:
            kind = "object" if "properties" in schema else "array" if "items" in schema else None
        if kind == "string":
            return self._string(schema)
        if kind in _SCALAR:
            return json_rule({k: v for k, v in schema.items() if k not in ("$defs", "definitions")})
        if kind == "object":
            return self._object(schema, depth)
        if kind == "array":
            return self._array(schema, depth)
        return "g_value"

    def _named_ref(self, ref: str, depth: int) -> str:
        """A rule of its own for a `$ref`, built once (a recursive schema refers back to it)."""
        if ref not in self._refs:
            name = self._refs[ref] = f"{self.prefix}_ref_{len(self._refs)}"
            self.rules.append(f"{name}: {self.value(resolve_ref({'$ref': ref}, self.root), depth + 1)}\n")
        return self._refs[ref]

    def _rule(self, body: str) -> str:
        name = f"{self.prefix}_v_{len(self.rules)}"
        self.rules.append(f"{name}: {body}\n")
        return name

    def _string(self, schema: dict) -> str:
        """A string: the delimiter, its text (its length and pattern kept), the delimiter."""
        parts = []
        low, high = schema.get("minLength"), schema.get("maxLength")
        if isinstance(low, int) or isinstance(high, int):
            parts.append(f"/(?s:.{{{low if isinstance(low, int) else 0},{high if isinstance(high, int) else ''}}})/")
        if isinstance(schema.get("pattern"), str):
            parts.append(f"/{_search(schema['pattern'])}/")
        if not parts:
            return "g_string"
        body = " & ".join(parts)
        k = f"{self.prefix.upper()}_{len(self.rules)}"
        lexeme, with_quote = f"GS_{k}", f"GSQ_{k}"
        texts = [f"/(?:{p[1:-1]})<\\|\"\\|>/" for p in parts]
        self.rules.append(f"{lexeme}: {body} & {_NO_QUOTE}\n")
        self.rules.append(f"{with_quote}: {' & '.join(texts)} & {_ENDS_AT_QUOTE}\n")
        return self._rule(f"{json.dumps(QUOTE)} ({lexeme} {json.dumps(QUOTE)} | {with_quote})")

    def _object(self, schema: dict, depth: int) -> str:
        """An object: its declared properties in sorted order (required ones always), comma-separated."""
        from edgeserve.text.formats.markup import separated

        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = [k for k in schema.get("required") or [] if isinstance(k, str)]
        props = {**{k: {} for k in required}, **props}
        extra = schema.get("additionalProperties")
        if not props:
            if extra is False:
                return '"{" "}"'
            if isinstance(extra, dict) and extra:
                member = self._rule(f'(G_KEY | g_string) ":" {self.value(extra, depth + 1)}')
                return self._rule(f'"{{" ({member} ("," {member})*)? "}}"')
            return "g_dict"
        items = []
        for key in sorted(props):
            head = lits(_key_text(key) + ":", (QUOTE,))
            items.append((self._rule(f"{head} {self.value(props[key], depth + 1)}"), key in required))
        return self._rule(f'"{{" {separated(items, ",")} "}}"')

    def _array(self, schema: dict, depth: int) -> str:
        """An array: items of its `items` schema, as many as minItems / maxItems allow."""
        item = self._rule(self.value(schema.get("items"), depth + 1))
        low = schema.get("minItems") if isinstance(schema.get("minItems"), int) else 0
        high = schema.get("maxItems") if isinstance(schema.get("maxItems"), int) else None
        if high is not None and high <= 0:
            return '"[" "]"'
        more = f"{{{max(low - 1, 0)},{high - 1}}}" if high is not None else "*" if low <= 1 else f"{{{low - 1},}}"
        items = f'{item} ("," {item}){more}'
        return self._rule(f'"[" {items} "]"' if low >= 1 else f'"[" ({items})? "]"')


def _search(pattern: str) -> str:
    """A JSON schema `pattern` (found anywhere in the string unless anchored) as a whole-text regex for a Lark
    regex literal."""
    start = pattern.startswith("^")
    end = pattern.endswith("$") and not pattern.endswith("\\$")
    core = pattern[1 if start else 0: len(pattern) - 1 if end else len(pattern)]
    whole = ("" if start else "(?s:.*)") + f"(?:{core})" + ("" if end else "(?s:.*)")
    return re.sub(r"(?<!\\)/", r"\/", whole)
