"""Tools parsing for every API: function definitions (checked, in the OpenAI chat shape that chat_setup and the
templates use), `tool_choice` (including OpenAI's allowed_tools) and `parallel_tool_calls`.

A bad value is a 400 naming the field. Whether a parameters schema is supported is decided when it is compiled for
the model's tokenizer (`Generation.prepare`): a 400 naming the unsupported keywords.
"""

from __future__ import annotations

from typing import Any, Callable

from edgeserve.server.errors import bad_request
from edgeserve.server.request import GenerationRequest

MAX_TOOLS = 128


def function_tool(fn: Any, here: str, params_key: str = "parameters") -> dict:
    """One function definition (`name`, `description`?, a JSON schema under `params_key`?) checked, with a 400
    naming `here`.field otherwise, and returned in the OpenAI tools shape (what chat_setup and the templates use).
    The Anthropic and Responses routes call it on their flat tool objects."""
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad_request(f"{here}.name is required and must be a non-empty string", f"{here}.name")
    params = fn.get(params_key)
    if params is not None and not isinstance(params, dict):
        raise bad_request(f"{here}.{params_key} must be a JSON schema object", f"{here}.{params_key}")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise bad_request(f"{here}.description must be a string", f"{here}.description")
    out = {"name": fn["name"], "description": fn.get("description"), "parameters": params}
    return {"type": "function", "function": {k: v for k, v in out.items() if v is not None}}


def parse_tool_list(value: Any, one: Callable[[Any, str], dict]) -> list[dict] | None:
    """A `tools` list, each item made an OpenAI-shaped function by `one(item, "tools[i]")`; at most MAX_TOOLS,
    names unique."""
    if value in (None, []):
        return None
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise bad_request(f"tools must be a list of at most {MAX_TOOLS} function definitions", "tools")
    out, names = [], set()
    for i, tool in enumerate(value):
        fn = one(tool, f"tools[{i}]")
        name = fn["function"]["name"]
        if name in names:
            raise bad_request(f"tools[{i}]: function name {name!r} is defined twice", f"tools[{i}]")
        names.add(name)
        out.append(fn)
    return out


def _openai_tool(tool: Any, here: str) -> dict:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise bad_request(f"{here} must be {{\"type\": \"function\", \"function\": {{...}}}}", here)
    return function_tool(tool.get("function"), f"{here}.function")


def parse_tools(value: Any) -> list[dict] | None:
    """OpenAI / Ollama `tools`: [{"type": "function", "function": {"name", "description"?, "parameters"?}}]."""
    return parse_tool_list(value, _openai_tool)


def parse_tool_choice(value: Any, tools: list[dict] | None) -> str | dict:
    """"none", "auto", "required" or {"name": function}; a named or required choice needs tools."""
    if value is None:
        return "auto" if tools else "none"
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise bad_request("tool_choice 'required' needs tools", "tool_choice")
        return value
    name = None
    if isinstance(value, dict) and value.get("type", "function") == "function":
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else value.get("name")
    if not isinstance(name, str):
        raise bad_request("tool_choice must be 'none', 'auto', 'required' or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if not tools or name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
    return {"name": name}


def set_tools(req: GenerationRequest, tools: list[dict] | None, body: dict) -> None:
    """The request's tools (already parsed), `tool_choice` and `parallel_tool_calls` from `body`.

    A forced call beside a response format is accepted, as OpenAI does: the tool choice governs this turn (its
    grammar replaces the format's), the format the final text turn once the tools have answered."""
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        choice, tools = allowed_tools(choice, tools)
    req.tools = tools
    req.tool_choice = parse_tool_choice(choice, req.tools)
    ptc = body.get("parallel_tool_calls")
    if ptc not in (None, True, False):
        raise bad_request("parallel_tool_calls must be true or false", "parallel_tool_calls")
    req.parallel_tool_calls = ptc


def allowed_tools(value: dict, tools: list[dict] | None) -> tuple[str, list[dict] | None]:
    """OpenAI's tool_choice {"type": "allowed_tools", ...} as (mode, the tools it allows): Chat Completions nests
    {"mode", "tools": [{"type": "function", "function": {"name"}}]} under "allowed_tools", Responses puts
    "mode" and "tools" ([{"type": "function", "name"}]) beside "type". Only the allowed tools reach the prompt."""
    spec = value.get("allowed_tools", value)
    listed = spec.get("tools") if isinstance(spec, dict) else None
    mode = spec.get("mode", "auto") if isinstance(spec, dict) else None
    if mode not in ("auto", "required") or not isinstance(listed, list) or not listed:
        raise bad_request("tool_choice allowed_tools needs a mode ('auto' or 'required') and a non-empty list of "
                          "tools", "tool_choice")
    known = {t["function"]["name"] for t in tools or []}
    names = set()
    for i, t in enumerate(listed):
        fn = t.get("function", t) if isinstance(t, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or name not in known:
            raise bad_request(f"tool_choice allowed_tools tools[{i}] must name a function in tools, got {name!r}",
                              "tool_choice")
        names.add(name)
    return mode, [t for t in tools or [] if t["function"]["name"] in names]
