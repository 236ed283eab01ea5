"""The one message parser: every API's conversation becomes chat messages in one shape.

A chat message is {"role", "content"} with, where present, `tool_calls` (OpenAI-shaped, arguments as JSON text),
`tool_call_id` / `tool_name` (a tool result), `name`, and `reasoning_content` (an assistant's earlier reasoning):
what the chat templates read (edgeserve/server/chat_setup.py). The API adapters walk their own shapes (OpenAI and
Ollama messages here; Anthropic content blocks and Responses input items in their adapters) and build every
piece with the functions below: content parts (text, and images: each becomes an `ImageInput` in the message's
`images` and a marker in its text where it stood, edgeserve/server/image_parts.py), tool calls, tool results and
reasoning, each checked with a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

from edgeserve.server.errors import bad_request
from edgeserve.server.image_parts import IMAGE_PART_TYPES, ImageInput, base64_images, image_part

ROLES = {"system", "user", "assistant", "developer", "tool"}
MESSAGE_KEYS = {"role", "content", "name", "images", "tool_calls", "tool_call_id", "tool_name", "thinking",
                "reasoning_content"}


def content_text(content: Any, where: str, part_types: Iterable[str] = ("text",),
                 part_keys: set[str] | None = None, noun: str = "content part",
                 images: list[ImageInput] | None = None) -> str:
    """A message's content as text: a string, or a list of text parts (`{"type": one of part_types, "text"}`)
    joined; any other part is a 400 naming it. `part_keys`: the keys a part may have (None: any); `noun`: what
    the API calls a part (Anthropic: content block). With `images` (a list to fill), image parts are taken too:
    each is appended there and its marker stands in the text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text {noun}s", where)
    return "".join(content_part(part, f"{where}[{j}]", tuple(part_types), part_keys, noun, images)
                   for j, part in enumerate(content))


def content_part(part: Any, here: str, part_types: tuple[str, ...], part_keys: set[str] | None, noun: str,
                 images: list[ImageInput] | None) -> str:
    """One content part's text: a text part's, or (where `images` is given) an image part's marker."""
    if images is not None and isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
        image = image_part(part, here)
        images.append(image)
        return image.mark
    return text_part(part, here, part_types, part_keys, noun)


def text_part(part: Any, here: str, part_types: tuple[str, ...] = ("text",), part_keys: set[str] | None = None,
              noun: str = "content part") -> str:
    """One text content part's text (400 for another kind of part, a missing text or an unknown key)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in part_types:
        kind = kind if isinstance(part, dict) else type(part).__name__
        raise bad_request(f"{here} must be a text {noun} ({' / '.join(part_types)}); type {kind!r} is not "
                          "supported", here)
    if not isinstance(part.get("text"), str):
        raise bad_request(f"{here}.text must be a string", f"{here}.text")
    extra = set(part) - part_keys if part_keys is not None else set()
    if extra:
        raise bad_request(f"{here}.{sorted(extra)[0]} is not supported", f"{here}.{sorted(extra)[0]}")
    return part["text"]


def tool_call(call_id: str, name: Any, arguments: Any, here: str, args_field: str = "arguments") -> dict[str, Any]:
    """One call in the chat shape ({"id", "type": "function", "function": {"name", "arguments"}}); `arguments`
    as JSON text (checked) or an object; `args_field` is how the API names them (for the 400)."""
    if not isinstance(name, str) or not name:
        raise bad_request(f"{here}.name is required and must be a non-empty string", f"{here}.name")
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            raise bad_request(f"{here}.{args_field} is not valid JSON", f"{here}.{args_field}") from None
        if not isinstance(value, dict):  # templates iterate the arguments as an object (Qwen3.5's do)
            raise bad_request(f"{here}.{args_field} must be a JSON object", f"{here}.{args_field}")
        text = arguments
    elif isinstance(arguments, dict):
        text = json.dumps(arguments, ensure_ascii=False)
    else:
        raise bad_request(f"{here}.{args_field} must be JSON text or an object", f"{here}.{args_field}")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def tool_result(call_id: str, content: str, is_error: bool = False) -> dict[str, Any]:
    """A tool message answering the call `call_id`."""
    return {"role": "tool", "tool_call_id": call_id, "content": f"Error: {content}" if is_error else content}


def assistant(content: str, calls: list[dict] | None = None, reasoning: str | None = None) -> dict[str, Any]:
    """An assistant turn: its text, tool calls and earlier reasoning."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = calls
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    return msg


def parse_messages(value: Any, where: str = "messages", tool_call_ids: bool = False) -> list[dict[str, Any]]:
    """OpenAI / Ollama chat messages as chat messages, content flattened from text parts; anything else is a 400.

    `tool_call_ids`: a tool message must name the call it answers (`tool_call_id`, as OpenAI requires; Ollama's
    tool messages carry at most a `tool_name`)."""
    if not isinstance(value, list) or not value:
        raise bad_request(f"{where} is required and must be a non-empty list of messages", where)
    return [_message(m, f"{where}[{i}]", tool_call_ids) for i, m in enumerate(value)]


def _message(m: Any, here: str, tool_call_ids: bool) -> dict[str, Any]:
    """One OpenAI / Ollama message, checked."""
    if not isinstance(m, dict):
        raise bad_request(f"{here} must be an object with role and content", here)
    extra = set(m) - MESSAGE_KEYS
    if extra:
        raise bad_request(f"{here}.{sorted(extra)[0]} is not supported", f"{here}.{sorted(extra)[0]}")
    role = m.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise bad_request(f"{here}.role must be one of system, user, assistant, developer, tool; got {role!r}",
                          f"{here}.role")
    if tool_call_ids and role == "tool" and m.get("tool_call_id") is None:
        raise bad_request(f"{here}.tool_call_id is required on a tool message (the id of the call it answers)",
                          f"{here}.tool_call_id")
    images = base64_images(m["images"], f"{here}.images") if m.get("images") is not None else []  # Ollama's
    content = m.get("content")
    if content is None and role in ("assistant", "tool"):
        content = ""
    content = "".join(i.mark for i in images) + content_text(content, f"{here}.content", ("text",), noun="part",
                                                             images=images)
    out = {"role": "system" if role == "developer" else role, "content": content, **message_tool_fields(m, here)}
    return {**out, "images": images} if images else out


def message_tool_fields(m: dict, here: str) -> dict[str, Any]:
    """The tool fields of one OpenAI / Ollama message, checked: assistant `tool_calls` (arguments as JSON text or
    an object), a tool message's `tool_call_id` (OpenAI) / `tool_name` (Ollama), `name`, and an assistant's earlier
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
        out["tool_calls"] = [_message_call(c, f"{here}.tool_calls[{j}]", j) for j, c in enumerate(calls)]
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


def _message_call(c: Any, here: str, j: int) -> dict[str, Any]:
    """One entry of an assistant message's `tool_calls` (OpenAI: arguments as JSON text; Ollama: an object)."""
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"{here}.function.name is required", here)
    return tool_call(c.get("id") or f"call_{j}", fn["name"], fn.get("arguments", {}), f"{here}.function")


# values of continue_final_message: vLLM's boolean, llama-server's field names
_CONTINUATIONS = {True: "auto", "auto": "auto", "content": "content", "reasoning_content": "reasoning",
                  "reasoning": "reasoning"}


def set_continuation(req: Any, messages: list[dict[str, Any]], continue_final: Any = None,
                     add_generation_prompt: Any = None, param: str = "continue_final_message") -> None:
    """Assistant prefill on `req` (GenerationRequest.continue_final_message / add_generation_prompt): asked for
    (`continue_final`: true, "content", "reasoning_content"), or, with neither field said, a conversation that ends
    with an assistant message (without tool calls) is continued, as llama-server does. Continuing without a final
    assistant message, one with tool calls, or together with add_generation_prompt true is a 400."""
    if continue_final is not None and not (continue_final is False or (isinstance(continue_final, (bool, str))
                                                                       and continue_final in _CONTINUATIONS)):
        raise bad_request(f"{param} must be true, false, \"content\" or \"reasoning_content\"", param)
    if add_generation_prompt is not None and not isinstance(add_generation_prompt, bool):
        raise bad_request("add_generation_prompt must be true or false", "add_generation_prompt")
    last = messages[-1] if messages else {}
    if continue_final in (None, False):
        implicit = continue_final is None and add_generation_prompt is None and last.get("role") == "assistant" \
            and not last.get("tool_calls")
        req.continue_final_message = "auto" if implicit else None
        req.add_generation_prompt = not implicit and add_generation_prompt is not False
        return
    if add_generation_prompt is True:
        raise bad_request(f"{param} and add_generation_prompt cannot both be true", param)
    if last.get("role") != "assistant":
        raise bad_request(f"{param} needs the conversation to end with an assistant message to continue", param)
    if last.get("tool_calls"):
        raise bad_request(f"{param}: an assistant message with tool calls cannot be continued", param)
    req.continue_final_message, req.add_generation_prompt = _CONTINUATIONS[continue_final], False
