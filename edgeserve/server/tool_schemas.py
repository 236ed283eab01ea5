"""Request fields for structured output, tool calling and reasoning, for the OpenAI and Ollama routes.

Each parser fills the `GenerationRequest` fields of its block (`constraint`, `tools`, `tool_choice`,
`parallel_tool_calls`, `template_kwargs`, `think`); a bad value is a 400 naming the field. Whether a schema is
supported is decided when it is compiled for the model's tokenizer (`Generation.prepare`): a 400 naming the
unsupported keywords.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Callable

from edgeserve.server.errors import bad_request
from edgeserve.text.grammar import GrammarSpec

if TYPE_CHECKING:
    from edgeserve.server.schemas import GenerationRequest

MAX_TOOLS = 128
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's reasoning_effort values


def parse_response_format(value: Any, param: str = "response_format") -> GrammarSpec | None:
    """OpenAI `response_format`: {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request(f"{param}.json_schema must be an object with name and schema", f"{param}.json_schema")
        schema = spec.get("schema", {"type": "object"})  # OpenAI: no schema means any object
        if not isinstance(schema, dict):
            raise bad_request(f"{param}.json_schema.schema must be a JSON schema object", f"{param}.json_schema.schema")
        if spec.get("strict") not in (None, True, False):
            raise bad_request(f"{param}.json_schema.strict must be true or false", f"{param}.json_schema.strict")
        return GrammarSpec.json_schema(schema)
    raise bad_request(f"{param}.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", param)


def parse_ollama_format(value: Any) -> GrammarSpec | None:
    """Ollama `format`: "json" (any JSON object) or a JSON schema."""
    if value in (None, ""):
        return None
    if value == "json":
        return GrammarSpec("json_object")
    if isinstance(value, dict):
        return GrammarSpec.json_schema(value)
    raise bad_request(f"format must be \"json\" or a JSON schema object, got {value!r}", "format")


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


def _template_kwargs(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and not k.startswith("_") for k in value):
        raise bad_request("chat_template_kwargs must be an object of template variables", "chat_template_kwargs")
    reserved = sorted(set(value) & {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {reserved[0]!r}", "chat_template_kwargs")
    if "enable_thinking" in value and not isinstance(value["enable_thinking"], bool):
        raise bad_request("chat_template_kwargs.enable_thinking must be true or false",
                          "chat_template_kwargs.enable_thinking")
    return dict(value)


def parse_openai_tools(body: dict, req: "GenerationRequest", chat: bool) -> None:
    """response_format (chat and completions); tools, tool_choice, parallel_tool_calls, chat_template_kwargs
    (chat only)."""
    req.constraint = parse_response_format(body.get("response_format"))
    if not chat:
        return
    set_tools(req, parse_tools(body.get("tools")), body, "response_format")
    req.template_kwargs = _template_kwargs(body.get("chat_template_kwargs"))
    if "enable_thinking" in req.template_kwargs:
        req.think = req.template_kwargs["enable_thinking"]
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad_request(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}", "reasoning_effort")
        req.template_kwargs.setdefault("reasoning_effort", effort)  # harmony's Reasoning: level (gpt-oss)
        if effort == "none" and "enable_thinking" not in req.template_kwargs:
            req.think = False  # reasoning off (enable_thinking false); a harmony model's lowest level


def parse_ollama_tools(body: dict, req: "GenerationRequest", chat: bool) -> None:
    """Ollama `format`, and on /api/chat `tools` and `think`."""
    req.constraint = parse_ollama_format(body.get("format"))
    think = body.get("think")
    if think is not None:
        if think in ("low", "medium", "high"):  # gpt-oss levels: harmony's Reasoning: level
            req.template_kwargs["reasoning_effort"] = think
            think = True
        if not isinstance(think, bool):
            raise bad_request(f"think must be true or false, got {think!r}", "think")
        req.think = think
    if chat:
        req.tools = parse_tools(body.get("tools"))
        req.tool_choice = "auto" if req.tools else "none"


def parse_message_tool_fields(m: dict, here: str) -> dict[str, Any]:
    """The tool fields of one chat message, checked: assistant `tool_calls` (arguments as JSON text or an object),
    a tool message's `tool_call_id` (OpenAI) / `tool_name` (Ollama), `name`, and an assistant's earlier
    reasoning (`reasoning_content` / Ollama `thinking`); all reach the chat template as message fields."""
    out: dict[str, Any] = {}
    name = m.get("name")
    if name is not None:
        if not isinstance(name, str) or not name:
            raise bad_request(f"{here}.name must be a non-empty string", f"{here}.name")
        out["name"] = name
    calls = m.get("tool_calls")
    if calls is not None:
        if m.get("role") != "assistant" or not isinstance(calls, list):
            raise bad_request(f"{here}.tool_calls must be a list, on an assistant message", f"{here}.tool_calls")
        norm = []
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise bad_request(f"{here}.tool_calls[{j}].function.name is required", f"{here}.tool_calls[{j}]")
            args = fn.get("arguments", {})
            if isinstance(args, str):
                try:
                    value = json.loads(args or "{}")
                except json.JSONDecodeError:
                    raise bad_request(f"{here}.tool_calls[{j}].function.arguments is not valid JSON",
                                      f"{here}.tool_calls[{j}].function.arguments") from None
                if not isinstance(value, dict):  # templates iterate the arguments as an object (Qwen3.5's do)
                    raise bad_request(f"{here}.tool_calls[{j}].function.arguments must be a JSON object",
                                      f"{here}.tool_calls[{j}].function.arguments")
            elif not isinstance(args, dict):
                raise bad_request(f"{here}.tool_calls[{j}].function.arguments must be JSON text or an object",
                                  f"{here}.tool_calls[{j}].function.arguments")
            norm.append({"id": c.get("id") or f"call_{j}", "type": "function",
                         "function": {"name": fn["name"], "arguments": args if isinstance(args, str)
                                      else json.dumps(args, ensure_ascii=False)}})
        out["tool_calls"] = norm
    thought = m.get("reasoning_content", m.get("thinking"))
    if thought is not None:
        if m.get("role") != "assistant" or not isinstance(thought, str):
            raise bad_request(f"{here}.reasoning_content must be a string, on an assistant message",
                              f"{here}.reasoning_content")
        out["reasoning_content"] = thought  # templates that show earlier reasoning read this name
    for key in ("tool_call_id", "tool_name"):
        value = m.get(key)
        if value is not None:
            if m.get("role") != "tool" or not isinstance(value, str):
                raise bad_request(f"{here}.{key} must be a string, on a tool message", f"{here}.{key}")
            out[key] = value
    return out


def set_tools(req, tools, body: dict, format_param: str) -> None:
    """The request's tools (already parsed), `tool_choice` and `parallel_tool_calls` from `body`; a forced tool call
    beside a format constraint (`req.constraint`, from the field `format_param`) is a 400 naming that field."""
    req.tools = tools
    req.tool_choice = parse_tool_choice(body.get("tool_choice"), req.tools)
    ptc = body.get("parallel_tool_calls")
    if ptc not in (None, True, False):
        raise bad_request("parallel_tool_calls must be true or false", "parallel_tool_calls")
    req.parallel_tool_calls = ptc is not False
    if req.constraint is not None and req.tool_choice not in ("none", "auto"):
        raise bad_request(f"{format_param} cannot be combined with tool_choice 'required' or a named function",
                          format_param)
