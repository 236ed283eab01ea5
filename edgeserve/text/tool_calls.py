"""Tool calls: the formats chat templates use, rendering tools into prompts, parsing calls out of replies.

Formats (picked from the chat template's source by `detect_format`):

- "hermes" (Hermes, Qwen2.5/3, most others): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one per call.
- "mistral": `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
- "llama3": a bare JSON object `{"name": ..., "parameters": {...}}` (or `<|python_tag|>` before it), several
  separated by `;`.
- "gemma4": `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:5}<tool_call|>`, one per call: the arguments an object
  with bare keys and strings between `<|"|>` delimiters.
- "qwen3_coder" (Qwen3-Coder, Qwen3.5 / 3.6): `<tool_call>` around `<function=NAME>`, one
  `<parameter=ARG>VALUE</parameter>` per argument, each tag on its own line; values are text typed by the tool's
  schema (edgeserve.text.xml_tool_calls).

A template that knows no tools (it never mentions `tools`) gets them in the system prompt, in the hermes format
(`TOOLS_SYSTEM_PROMPT`), and tool calls / tool results in the history are written into message text the same way.

With `tool_choice` "required" or a named function the reply is constrained by a grammar instead (`forced_schema`):
a named function's reply is its arguments object; "required" replies with a JSON array of
`{"name": ..., "arguments": {...}}` (one item when parallel tool calls are off). The parsers read those back.
A format in `NATIVE_FORCED` is forced in its own markup instead (`forced_call_grammar` of its module), and read
back by its own parser.
"""

from __future__ import annotations

import json
import re
from typing import Any

from edgeserve.text.formats.base import ToolCall
from edgeserve.text.xml_tool_calls import FUNCTION_OPEN, parse_xml_calls, template_writes_xml_calls

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_TAG = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
GEMMA4_CALL_OPEN, GEMMA4_CALL_CLOSE, GEMMA4_QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
NATIVE_FORCED = frozenset({"qwen3_coder"})  # formats whose forced calls are grammars of their own markup, not JSON

TOOLS_SYSTEM_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}"
    "\n</tool_call>"
)


def detect_format(template_source: str) -> str:
    """The tool-call format a chat template uses: "hermes", "mistral", "llama3", "gemma4" or "qwen3_coder"."""
    if GEMMA4_CALL_OPEN in template_source:
        return "gemma4"
    if template_writes_xml_calls(template_source):
        return "qwen3_coder"
    if TOOL_CALL_OPEN in template_source:
        return "hermes"
    if MISTRAL_TAG in template_source:
        return "mistral"
    if PYTHON_TAG in template_source or ("ipython" in template_source and "tools" in template_source):
        return "llama3"
    return "hermes"


def template_knows_tools(template_source: str) -> bool:
    """Whether a chat template renders `tools` itself."""
    return "tools" in template_source


def start_markers(fmt: str) -> list[str]:
    """Text that starts a tool call in a reply of format `fmt` (content is held back from there)."""
    return {"hermes": [TOOL_CALL_OPEN], "mistral": [MISTRAL_TAG], "llama3": [PYTHON_TAG, '{"name"'],
            "gemma4": [GEMMA4_CALL_OPEN], "qwen3_coder": [TOOL_CALL_OPEN, FUNCTION_OPEN]}[fmt]


# --- prompts --------------------------------------------------------------------------------------------------


def tools_system_prompt(tools: list[dict]) -> str:
    """The documented system-prompt block listing `tools` for templates that know none."""
    return TOOLS_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def messages_for_template(messages: list[dict[str, Any]], tools: list[dict] | None,
                          template_source: str) -> list[dict[str, Any]]:
    """Messages as the template should see them. A template that knows tools gets them as they are (assistant
    `tool_calls` with arguments as objects, as HF templates expect). For one that does not: the tools go into the
    system prompt, assistant calls become `<tool_call>` text and tool results user text in `<tool_response>`."""
    if template_knows_tools(template_source):
        out = []
        for m in messages:
            if m.get("tool_calls"):
                m = {**m, "tool_calls": [_with_object_arguments(c) for c in m["tool_calls"]]}
            out.append(m)
        return out
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = "\n".join(f"{TOOL_CALL_OPEN}\n{json.dumps(_call_json(c), ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"
                              for c in m.pop("tool_calls"))
            m["content"] = ((m.get("content") or "") + "\n" + calls).strip()
        if m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content', '')}\n</tool_response>"}
        m.pop("tool_call_id", None)
        out.append(m)
    if tools:
        block = tools_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _call_json(call: dict) -> dict:
    fn = call.get("function", {})
    return {"name": fn.get("name"), "arguments": _arguments_object(fn.get("arguments"))}


def _with_object_arguments(call: dict) -> dict:
    fn = call.get("function", {})
    return {**call, "function": {**fn, "arguments": _arguments_object(fn.get("arguments"))}}


def _arguments_object(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return args


# --- constrained calls ----------------------------------------------------------------------------------------


def function_parameters(tool: dict) -> dict:
    """A tool's parameters schema (an empty object schema when it has none)."""
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object", "properties": {}}


def forced_schema(tools: list[dict], choice: str | None, parallel: bool) -> dict:
    """The JSON schema a reply must match under tool_choice "required" (choice None) or a named function."""
    if choice is not None:
        tool = next(t for t in tools if t["function"]["name"] == choice)
        return function_parameters(tool)
    items = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               "arguments": function_parameters(t)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items},
                              "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_forced(text: str, choice: str | None) -> list[ToolCall]:
    """The calls in a reply constrained by `forced_schema` (none if it was cut short)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    if choice is not None:
        return [ToolCall(choice, json.dumps(value, ensure_ascii=False))]
    return [ToolCall(v["name"], json.dumps(v.get("arguments", {}), ensure_ascii=False))
            for v in value if isinstance(v, dict) and isinstance(v.get("name"), str)]


# --- parsing free replies -------------------------------------------------------------------------------------


def _call_from(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = _arguments_object(args)
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str) -> list[Any]:
    """Consecutive JSON values in `text` (separated by whitespace, commas or semicolons); stops at junk."""
    decoder, values, i = json.JSONDecoder(), [], 0
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
    return values


def parse_tool_calls(text: str, fmt: str, known: set[str],
                     schemas: dict[str, dict] | None = None) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a free reply in format `fmt`; calls to functions not in `known` are left as text.
    `schemas` (function name -> parameters schema) types the values of formats that write them as text."""
    calls: list[ToolCall] = []
    if fmt == "qwen3_coder":
        params = {name: (schemas or {}).get(name) or {} for name in known}
        content, found = parse_xml_calls(text, params)
        return content, [ToolCall(name, json.dumps(args, ensure_ascii=False)) for name, args in found]
    if fmt == "hermes":
        pattern = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(TOOL_CALL_CLOSE) + r"|$)",
                             re.S)
        kept, last = [], 0
        for m in pattern.finditer(text):
            values = _json_values(m.group(1))
            found = [c for c in map(_call_from, values) if c is not None and c.name in known]
            if found:
                calls += found
                kept.append(text[last:m.start()])
                last = m.end()
        content = "".join(kept) + text[last:]
        return content.strip() if calls else text, calls
    if fmt == "gemma4":
        return _parse_gemma4(text, known)
    if fmt == "mistral":
        at = text.find(MISTRAL_TAG)
        if at < 0:
            return text, []
        values = _json_values(text[at + len(MISTRAL_TAG):])
        flat = [x for v in values for x in (v if isinstance(v, list) else [v])]
        calls = [c for c in map(_call_from, flat) if c is not None and c.name in known]
        return (text[:at].strip(), calls) if calls else (text, [])
    # llama3: the reply is the call(s): a JSON object, maybe after <|python_tag|>
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):]
    if not body.lstrip().startswith("{"):
        return text, []
    calls = [c for c in map(_call_from, _json_values(body)) if c is not None and c.name in known]
    return ("", calls) if calls else (text, [])


_GEMMA4_CALL = re.compile(
    re.escape(GEMMA4_CALL_OPEN) + r"call:([\w.\-]+)(.*?)(?:" + re.escape(GEMMA4_CALL_CLOSE) + r"|$)", re.S)
_BARE_KEY = re.compile(r"([{,]\s*)([A-Za-z_][\w\-]*)\s*:")


def _parse_gemma4(text: str, known: set[str]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a Gemma 4 reply: each `<|tool_call>call:NAME{...}<tool_call|>` whose arguments read as
    an object and whose function is known becomes a call; the rest stays text."""
    calls: list[ToolCall] = []
    kept, last = [], 0
    for m in _GEMMA4_CALL.finditer(text):
        args = gemma4_arguments(m.group(2).strip())
        if m.group(1) in known and args is not None:
            calls.append(ToolCall(m.group(1), json.dumps(args, ensure_ascii=False)))
            kept.append(text[last:m.start()])
            last = m.end()
    content = "".join(kept) + text[last:]
    return (content.strip(), calls) if calls else (text, [])


def gemma4_arguments(body: str) -> dict | None:
    """Gemma 4's call arguments (`{key:<|"|>text<|"|>,n:5,xs:[1,2]}`) as a dict, or None when they are not an
    object: the `<|"|>` strings become JSON strings and the bare keys outside them get quoted."""
    if not body.startswith("{"):
        return None
    parts = body.split(GEMMA4_QUOTE)
    if len(parts) % 2 == 0:
        return None  # an unclosed string
    pieces = [json.dumps(p, ensure_ascii=False) if i % 2 else _BARE_KEY.sub(r'\1"\2":', p)
              for i, p in enumerate(parts)]
    try:
        value = json.loads("".join(pieces))
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None
