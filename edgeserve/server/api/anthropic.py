"""Anthropic adapter (Messages API): POST /v1/messages (JSON or SSE with Anthropic's event sequence) and
POST /v1/messages/count_tokens, translated into a GenerationRequest and back. Errors use Anthropic's shape
(errors.error_body picks it by path).

Tools, tool_choice, thinking and output_config.format map onto the chat route's fields (tools, tool_choice,
think, constraint; see chat_setup); tool_use / tool_result / thinking blocks in the history become the chat
messages' tool_calls, tool messages and reasoning_content. Replies come back as thinking, text and tool_use
blocks (stop_reason "tool_use")."""

from __future__ import annotations

import json
import secrets
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edgeserve.server.body import read_request
from edgeserve.server.errors import APIError, anthropic_error_body, bad_request
from edgeserve.server.fields import model_name, number, reject_unknown, stop_list
from edgeserve.server.generation import ChoiceResult, Generation
from edgeserve.server.image_parts import image_part
from edgeserve.server.messages import (assistant, content_text, set_continuation, text_part, tool_call,
                                       tool_result)
from edgeserve.server.request import GenerationRequest
from edgeserve.server.respond import prompt_tokens, respond
from edgeserve.server.state import api_errors
from edgeserve.server.tools import function_tool, parse_tool_choice, parse_tool_list
from edgeserve.text.grammar import GrammarSpec
from edgeserve.text.tool_calls import ToolCall

_FIELDS = {"model", "messages", "system", "max_tokens", "temperature", "top_p", "top_k", "stop_sequences",
           "stream", "tools", "tool_choice", "thinking", "output_config"}
# accepted and changing nothing about the reply (bookkeeping, routing and caching hints)
_IGNORED = {"metadata", "service_tier", "cache_control", "inference_geo", "speed", "diagnostics", "workspace_id",
            "user_profile_id"}
_BLOCK_KEYS = {"type", "text", "cache_control", "citations"}
_EFFORTS = {"low", "medium", "high", "xhigh", "max"}
_CONSTRAINT_PARAM = "output_config.format"  # the field a structured-output grammar error names


def _text(content: Any, where: str) -> str:
    """A string, or a list of text blocks joined; any other block type is a 400 naming it."""
    return content_text(content, where, ("text",), _BLOCK_KEYS, "content block")


def _text_block(block: Any, here: str) -> str:
    return text_part(block, here, ("text",), _BLOCK_KEYS, "content block")


def _string(block: dict, key: str, here: str) -> str:
    value = block.get(key)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{here}.{key} is required and must be a non-empty string", f"{here}.{key}")
    return value


def _turn(role: str, content: Any, here: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: an assistant's text, thinking and tool_use blocks become one
    assistant message (`reasoning_content`, `tool_calls`); a user's tool_result blocks become tool messages,
    then its text a user message."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{here} must be a string or a list of content blocks", here)
    texts, calls, thoughts, results, images = [], [], [], [], []
    for j, block in enumerate(content):
        at = f"{here}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, at))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, at))
        elif kind == "thinking" and role == "assistant":
            if not isinstance(block.get("thinking"), str):
                raise bad_request(f"{at}.thinking must be a string", f"{at}.thinking")
            thoughts.append(block["thinking"])
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # encrypted by another server: nothing a local model can read
        elif kind == "image" and role == "user":
            images.append(image_part(block, at))
            texts.append(images[-1].mark)
        else:
            texts.append(_text_block(block, at))
    if role == "user":
        user = {"role": "user", "content": "".join(texts), **({"images": images} if images else {})}
        return results + ([user] if texts or not results else [])
    return [assistant("".join(texts), calls, "".join(thoughts) if thoughts else None)]


def _tool_use(block: dict, at: str) -> dict[str, Any]:
    """An assistant's tool_use block as a chat tool call."""
    args = block.get("input", {})
    if not isinstance(args, dict):
        raise bad_request(f"{at}.input must be an object", f"{at}.input")
    return tool_call(_string(block, "id", at), _string(block, "name", at), args, at, "input")


def _tool_result(block: dict, at: str) -> dict[str, Any]:
    """A user's tool_result block as a tool message (an error result says so)."""
    text = _text(block.get("content", ""), f"{at}.content")
    if block.get("is_error") not in (None, False, True):
        raise bad_request(f"{at}.is_error must be true or false", f"{at}.is_error")
    return tool_result(_string(block, "tool_use_id", at), text, bool(block.get("is_error")))


def _messages(body: dict) -> list[dict[str, Any]]:
    """`system` and `messages` as chat messages; a last assistant turn is prefill (set_continuation)."""
    out = []
    system = body.get("system")
    if system is not None:
        text = _text(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("messages is required and must be a non-empty list", "messages")
    for i, m in enumerate(msgs):
        here = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{here} must be an object with role and content", here)
        extra = set(m) - {"role", "content"}
        if extra:
            raise bad_request(f"{here}.{sorted(extra)[0]} is not supported", f"{here}.{sorted(extra)[0]}")
        if m.get("role") not in ("user", "assistant"):
            raise bad_request(f"{here}.role must be 'user' or 'assistant', got {m.get('role')!r}", f"{here}.role")
        out += _turn(m["role"], m.get("content"), f"{here}.content")
    if out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
        here = f"messages[{len(msgs) - 1}].content"
        raise bad_request(f"{here}: the last assistant turn has tool_use blocks, so it cannot be continued "
                          "(prefill)", here)
    return out


def _anthropic_tool(tool: Any, here: str) -> dict:
    """A custom tool ({name, description?, input_schema}) in the OpenAI tools shape; server tools are a 400."""
    if not isinstance(tool, dict):
        raise bad_request(f"{here} must be an object with name and input_schema", here)
    if tool.get("type") not in (None, "custom"):
        raise bad_request(f"{here}.type {tool['type']!r}: server tools are not supported (only custom tools with "
                          "an input_schema)", f"{here}.type")
    if not isinstance(tool.get("input_schema"), dict):
        raise bad_request(f"{here}.input_schema is required and must be a JSON schema object", f"{here}.input_schema")
    return function_tool(tool, here, "input_schema")


def _tool_choice(value: Any, tools: list[dict] | None) -> tuple[str | dict, bool]:
    """Anthropic tool_choice ({"type": auto | any | tool | none, "name", "disable_parallel_tool_use"}) as the
    chat route's tool_choice ("auto", "required", {"name"}, "none") and whether parallel calls are allowed."""
    if value is None:
        return parse_tool_choice(None, tools), True
    kinds = {"auto": "auto", "any": "required", "none": "none"}
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in (*kinds, "tool"):
        raise bad_request("tool_choice must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}", "tool_choice")
    parallel = value.get("disable_parallel_tool_use", False)
    if not isinstance(parallel, bool):
        raise bad_request("tool_choice.disable_parallel_tool_use must be true or false",
                          "tool_choice.disable_parallel_tool_use")
    if kind == "tool" and not isinstance(value.get("name"), str):
        raise bad_request("tool_choice.name is required with type 'tool'", "tool_choice.name")
    choice = {"type": "function", "name": value["name"]} if kind == "tool" else kinds[kind]
    if kind == "any" and not tools:
        raise bad_request("tool_choice 'any' needs tools", "tool_choice")
    return parse_tool_choice(choice, tools), not parallel


def _thinking(value: Any) -> bool | None:
    """`thinking`: enabled -> the template's reasoning on, disabled -> off, adaptive (or absent) -> its default."""
    kind = value.get("type") if isinstance(value, dict) else None
    if value is None or kind == "adaptive":
        return None
    if kind == "disabled":
        return False
    if kind == "enabled":
        budget = value.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise bad_request("thinking.budget_tokens must be a positive integer", "thinking.budget_tokens")
        return True
    raise bad_request("thinking must be {\"type\": \"enabled\", \"budget_tokens\": N}, {\"type\": \"disabled\"} or "
                      "{\"type\": \"adaptive\"}", "thinking")


def _output_format(value: Any) -> GrammarSpec | None:
    """`output_config`: `format` {"type": "json_schema", "schema"} is structured output; `effort` is accepted."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"format", "effort"}:
        raise bad_request("output_config must be an object with format and/or effort", "output_config")
    if value.get("effort") not in (None, *_EFFORTS):
        raise bad_request(f"output_config.effort must be one of {', '.join(sorted(_EFFORTS))}",
                          "output_config.effort")
    fmt = value.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad_request("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                          "output_config.format")
    return GrammarSpec.json_schema(fmt["schema"])


def parse_messages_request(body: dict) -> GenerationRequest:
    """Validate a POST /v1/messages body into a GenerationRequest (400 naming the field otherwise)."""
    reject_unknown(body, _FIELDS, _IGNORED, message="{bare}: Extra inputs are not permitted")
    req = GenerationRequest(model=model_name(body, "model: Field required (a non-empty string)"),
                            messages=_messages(body))
    set_continuation(req, req.messages)  # a final assistant message is prefill: the reply continues it
    req.tools = parse_tool_list(body.get("tools"), _anthropic_tool)
    req.tool_choice, req.parallel_tool_calls = _tool_choice(body.get("tool_choice"), req.tools)
    req.think = _thinking(body.get("thinking"))
    if req.think:  # enabled: budget_tokens is honoured as a budget, not only a level
        req.thinking_budget = body["thinking"]["budget_tokens"]
    req.constraint = _output_format(body.get("output_config"))
    # harmony's Reasoning: level (gpt-oss): output_config.effort, else the thinking budget in tokens
    effort = (body.get("output_config") or {}).get("effort") or (body.get("thinking") or {}).get("budget_tokens")
    if effort is not None:
        req.template_kwargs["reasoning_effort"] = effort
    _sampling(body, req)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream: must be true or false", "stream")
    req.stream = stream
    return req


def _sampling(body: dict, req: GenerationRequest) -> None:
    """max_tokens (required), temperature (0 to 1), top_p, top_k and stop_sequences."""
    mt = number(body, "max_tokens", integer=True)
    if mt is None or mt < 1:
        raise bad_request("max_tokens: Field required (a positive integer)", "max_tokens")
    req.max_tokens = mt
    temp = number(body, "temperature")
    if temp is not None:
        if not 0 <= temp <= 1:
            raise bad_request(f"temperature: must be between 0 and 1, got {temp}", "temperature")
        req.sampling["temperature"] = temp
    top_p = number(body, "top_p")
    if top_p is not None:
        req.sampling["top_p"] = top_p
    top_k = number(body, "top_k", integer=True)
    if top_k is not None:
        if not 0 <= top_k < 2**31:  # past the vocabulary it means no limit; huge values must not reach tensors
            raise bad_request(f"top_k: must be between 0 and {2**31 - 1}, got {top_k}", "top_k")
        req.sampling["top_k"] = top_k
    req.sampling["stop"] = stop_list(body.get("stop_sequences"), "stop_sequences")


def _stop_fields(finish: str | None, stop_reason: Any, stops: list[str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) in Anthropic's terms."""
    if finish == "length":
        return "max_tokens", None
    if finish == "tool_calls":
        return "tool_use", None
    if isinstance(stop_reason, str) and stop_reason in stops:
        return "stop_sequence", stop_reason
    return "end_turn", None


def _usage(gen: Generation, output_tokens: int) -> dict[str, int]:
    """Anthropic usage: input_tokens are the prompt tokens computed, cache_read_input_tokens those reused."""
    prompt = gen.usage.prompt_tokens or (gen.prompt_lens[0] if gen.prompt_lens else 0)
    cached = gen.usage.cached_tokens
    return {"input_tokens": prompt - cached, "output_tokens": output_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached}


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    """A parsed tool call as Anthropic's tool_use block (`input` an object; id toolu_ + the call's id)."""
    try:
        args = json.loads(call.arguments)
    except json.JSONDecodeError:
        args = None
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": args if isinstance(args, dict) else {}}


def content_blocks(r: ChoiceResult) -> list[dict[str, Any]]:
    """A reply's content: a thinking block (reasoning), a text block (unless the reply is only tool calls),
    then a tool_use block per call."""
    blocks: list[dict[str, Any]] = []
    if r.reasoning:
        blocks.append({"type": "thinking", "thinking": r.reasoning, "signature": ""})
    if r.text or not r.tool_calls:
        blocks.append({"type": "text", "text": r.text})
    return blocks + [tool_use_block(c) for c in r.tool_calls]


@api_errors
async def messages(request: Request) -> Response:
    """POST /v1/messages."""
    req = await read_request(request, parse_messages_request)
    return await respond(request, req, MessagesReplier(f"msg_{request.state.request_id}{secrets.token_hex(4)}"))


def _event(kind: str, **data: Any) -> dict:
    return {"event": kind, "data": json.dumps({"type": kind, **data}, ensure_ascii=False)}


def _error_event(err: APIError) -> dict:
    return {"event": "error", "data": json.dumps(anthropic_error_body(err), ensure_ascii=False)}


class _Blocks:
    """The content blocks of a streamed reply, opened one after another (index = position in `content`)."""

    def __init__(self) -> None:
        self.index = -1
        self.open_kind: str | None = None

    def start(self, block: dict) -> list[dict]:
        """Close the open block and start `block` (a ping follows the first one, as Anthropic sends it)."""
        out = self.close()
        self.index += 1
        self.open_kind = block["type"]
        out.append(_event("content_block_start", index=self.index, content_block=block))
        if self.index == 0:
            out.append(_event("ping"))
        return out

    def ensure(self, kind: str) -> list[dict]:
        """Events that make a `kind` (text / thinking) block the open one."""
        if self.open_kind == kind:
            return []
        return self.start({"type": "text", "text": ""} if kind == "text" else
                          {"type": "thinking", "thinking": "", "signature": ""})

    def close(self) -> list[dict]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [_event("content_block_stop", index=self.index)]


class MessagesReplier:
    """Anthropic's message object, or its stream: message_start, then per content block (thinking, text, tool_use)
    content_block_start, its deltas (thinking_delta, text_delta, input_json_delta) and content_block_stop, then
    message_delta and message_stop."""

    prompt_param = "messages"
    constraint_param = _CONSTRAINT_PARAM
    ndjson = False
    ping = _event("ping")

    def __init__(self, mid: str) -> None:
        self.mid = mid
        self.blocks = _Blocks()

    def error(self, err: APIError) -> dict:
        """Anthropic's error event."""
        return _error_event(err)

    def body(self, gen: Generation, results: list[ChoiceResult]) -> dict:
        """The message object."""
        r = results[0]
        reason, seq = _stop_fields(r.finish_reason, r.stop_reason, gen.req.sampling["stop"])
        return {"id": self.mid, "type": "message", "role": "assistant", "model": gen.model,
                "content": content_blocks(r), "stop_reason": reason, "stop_sequence": seq,
                "usage": _usage(gen, r.num_output_tokens)}

    async def stream(self, gen: Generation) -> AsyncIterator[dict]:
        """The whole event sequence."""
        start_usage = {"input_tokens": gen.prompt_lens[0] if gen.prompt_lens else 0, "output_tokens": 0,
                       "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        yield _event("message_start", message={"id": self.mid, "type": "message", "role": "assistant",
                                               "model": gen.model, "content": [], "stop_reason": None,
                                               "stop_sequence": None, "usage": start_usage})
        last = None
        async for _, out in gen.outputs():
            for e in self.text_events(out):
                yield e
            last = out
        for e in self.call_events((last.tool_calls if last else None) or []):
            yield e
        reason, seq = _stop_fields(last.finish_reason if last else None, last.stop_reason if last else None,
                                   gen.req.sampling.get("stop", []))
        n_out = last.num_output_tokens if last else 0
        yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": seq},
                     usage={"output_tokens": n_out, **{k: v for k, v in _usage(gen, n_out).items()
                                                       if k != "output_tokens"}})
        yield _event("message_stop")

    def text_events(self, out: Any) -> list[dict]:
        """The thinking and text deltas of one engine delta (opening their blocks as needed)."""
        events = []
        if out.reasoning:
            events += self.blocks.ensure("thinking")
            events.append(_event("content_block_delta", index=self.blocks.index,
                                 delta={"type": "thinking_delta", "thinking": out.reasoning}))
        if out.text:
            events += self.blocks.ensure("text")
            events.append(_event("content_block_delta", index=self.blocks.index,
                                 delta={"type": "text_delta", "text": out.text}))
        return events

    def call_events(self, calls: list[ToolCall]) -> list[dict]:
        """A tool_use block per call (its input in one input_json_delta), then the last block closed."""
        events = []
        if self.blocks.index < 0 and not calls:  # an empty reply still has its (empty) text block
            events += self.blocks.ensure("text")
        for call in calls:
            block = tool_use_block(call)
            events += self.blocks.start({**block, "input": {}})
            events.append(_event("content_block_delta", index=self.blocks.index,
                                 delta={"type": "input_json_delta",
                                        "partial_json": json.dumps(block["input"], ensure_ascii=False)}))
        return events + self.blocks.close()


@api_errors
async def count_tokens(request: Request) -> Response:
    """POST /v1/messages/count_tokens: the prompt's token count through the model's chat template."""
    req = await read_request(request, lambda body: parse_messages_request({**body, "max_tokens": 1, "stream": False}))
    return JSONResponse({"input_tokens": await prompt_tokens(request, req, "messages")})


ROUTES = [
    Route("/v1/messages", messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]
