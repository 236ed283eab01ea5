"""Tool calls: rendering tools into prompts, and the generic JSON reply that forced calls fall back to.

The formats models write their calls in (hermes, mistral, llama3, gemma4, qwen3_coder, ...) are the registry in
edgeserve.text.formats: one module per family, `detect_format` picks a template's.

A template that knows no tools (it never mentions `tools`) gets them in the system prompt, in the hermes format
(`TOOLS_SYSTEM_PROMPT`; in the first user message for a template that refuses a system role, as Gemma 2's), and
tool calls / tool results in the history are written into message text the same way.

With `tool_choice` "required" or a named function the reply is constrained by a grammar instead: the format's own
(`ChatFormat.forced`) where it has one, else `forced_schema`: a named function's reply is its arguments object;
"required" replies with a JSON array of `{"name": ..., "arguments": {...}}` (one item when parallel tool calls are
off). `parse_forced` reads those back.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from edgeserve.text.formats.base import ToolCall
from edgeserve.text.formats.json_calls import arguments_object

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"

TOOLS_SYSTEM_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}"
    "\n</tool_call>"
)


def template_knows_tools(template_source: str) -> bool:
    """Whether a chat template renders `tools` itself."""
    return "tools" in template_source


# --- prompts --------------------------------------------------------------------------------------------------


def tools_system_prompt(tools: list[dict]) -> str:
    """The documented system-prompt block listing `tools` for templates that know none."""
    return TOOLS_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def messages_for_template(messages: list[dict[str, Any]], tools: list[dict] | None, template_source: str,
                          system_role: bool = True,
                          tools_prompt: Callable[[list[dict]], str] | None = None,
                          native: bool = False, object_arguments: bool = True,
                          history_calls: Callable[[list[dict]], str] | None = None) -> list[dict[str, Any]]:
    """Messages as the template should see them. A template that knows tools gets them as they are (assistant
    `tool_calls` with arguments as objects, as HF templates expect). For one that does not: the tools go into the
    system prompt (into the first user message when the template refuses a system role: `system_role` false),
    assistant calls become `<tool_call>` text and tool results user text in `<tool_response>` (consecutive results
    one user message, so roles still alternate). A template that writes calls natively but lists no tools (its
    format's `tools_prompt`) gets the messages as they are and that prompt's tools block; so does one that gets the
    tools under another name (`native`: firefunction v2's `functions`), without the block. `object_arguments`
    false: the template concatenates call arguments as text (functionary v3.2), so they stay JSON text.
    `history_calls`: the format's writer of calls as its model writes them, used where the template never renders
    `tool_calls` (LFM2's): an assistant message's calls become that text after its content."""
    native = native or template_knows_tools(template_source)
    if native or tools_prompt is not None:
        out = []
        for m in messages:
            if m.get("tool_calls"):
                m = {**m, "tool_calls": [_with_object_arguments(c) if object_arguments else _with_text_arguments(c)
                                         for c in m["tool_calls"]]}
                if history_calls is not None and "tool_calls" not in template_source:
                    calls = [_with_object_arguments(c) for c in m.pop("tool_calls")]
                    m["content"] = _text(m.get("content")) + history_calls(calls)
            out.append(m)
        if tools_prompt is not None and tools and not native:
            return _with_tools_block(out, tools_prompt(tools), system_role)
        return out
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = "\n".join(f"{TOOL_CALL_OPEN}\n{json.dumps(_call_json(c), ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"
                              for c in m.pop("tool_calls"))
            m["content"] = ((m.get("content") or "") + "\n" + calls).strip()
        if m["role"] == "tool":
            response = f"<tool_response>\n{m.get('content', '')}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + response}
                continue
            m = {"role": "user", "content": response, "tool_results": True}
        m.pop("tool_call_id", None)
        out.append(m)
    out = [{k: v for k, v in m.items() if k != "tool_results"} for m in out]
    return _with_tools_block(out, tools_system_prompt(tools), system_role) if tools else out


def _with_tools_block(messages: list[dict[str, Any]], block: str, system_role: bool) -> list[dict[str, Any]]:
    """`messages` with the tools block added to the system message (a new one when there is none); for a template
    without a system role the system text goes before the first user message's content instead."""
    out = list(messages)
    system = ""
    if out and out[0]["role"] == "system":
        system = _text(out.pop(0).get("content")) + "\n\n"
    if system_role:
        return [{"role": "system", "content": system + block}, *out]
    first = next((i for i, m in enumerate(out) if m["role"] == "user"), None)
    if first is None:
        return [{"role": "user", "content": system + block}, *out]
    m = out[first]
    content = m.get("content")
    if isinstance(content, list):  # content parts: the text goes in as a part of its own, first
        out[first] = {**m, "content": [{"type": "text", "text": system + block + "\n\n"}, *content]}
    else:
        out[first] = {**m, "content": system + block + "\n\n" + _text(content)}
    return out


def _text(content: Any) -> str:
    """A message's content as text (the text parts of a list of parts)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content or ""


def _call_json(call: dict) -> dict:
    fn = call.get("function", {})
    return {"name": fn.get("name"), "arguments": arguments_object(fn.get("arguments"))}


def _with_text_arguments(call: dict) -> dict:
    fn = call.get("function", {})
    args = fn.get("arguments")
    return {**call, "function": {**fn, "arguments": args if isinstance(args, str)
                                 else json.dumps(args if args is not None else {}, ensure_ascii=False)}}


def _with_object_arguments(call: dict) -> dict:
    fn = call.get("function", {})
    return {**call, "function": {**fn, "arguments": arguments_object(fn.get("arguments"))}}


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
        return [ToolCall(choice, json.dumps(value, ensure_ascii=False))] if isinstance(value, dict) else []
    if not isinstance(value, list):
        return []
    return [ToolCall(v["name"], json.dumps(v.get("arguments", {}), ensure_ascii=False))
            for v in value if isinstance(v, dict) and isinstance(v.get("name"), str)]
