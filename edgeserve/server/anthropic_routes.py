"""Anthropic Messages API: POST /v1/messages (JSON or SSE with Anthropic's event sequence) and
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

from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edgeserve.server.errors import APIError, anthropic_error_body, bad_request, from_exception
from edgeserve.server.generation import ChoiceResult, Generation
from edgeserve.server.loading import is_loaded, start_generation, stream_after_load
from edgeserve.server.schemas import GenerationRequest, _number, _stop, parse_json_object
from edgeserve.server.state import api_errors, server_state
from edgeserve.server.tool_schemas import function_tool, parse_tool_choice, parse_tool_list
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
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content blocks", where)
    return "".join(_text_block(block, f"{where}[{j}]") for j, block in enumerate(content))


def _text_block(block: Any, here: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        raise bad_request(f"{here}: content block type {kind!r} is not supported here (only 'text')", here)
    if not isinstance(block.get("text"), str):
        raise bad_request(f"{here}.text must be a string", f"{here}.text")
    extra = set(block) - _BLOCK_KEYS
    if extra:
        raise bad_request(f"{here}.{sorted(extra)[0]} is not supported", f"{here}.{sorted(extra)[0]}")
    return block["text"]


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
    texts, calls, thoughts, results = [], [], [], []
    for j, block in enumerate(content):
        at = f"{here}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use" and role == "assistant":
            args = block.get("input", {})
            if not isinstance(args, dict):
                raise bad_request(f"{at}.input must be an object", f"{at}.input")
            calls.append({"id": _string(block, "id", at), "type": "function",
                          "function": {"name": _string(block, "name", at),
                                       "arguments": json.dumps(args, ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            text = _text(block.get("content", ""), f"{at}.content")
            if block.get("is_error") not in (None, False, True):
                raise bad_request(f"{at}.is_error must be true or false", f"{at}.is_error")
            results.append({"role": "tool", "tool_call_id": _string(block, "tool_use_id", at),
                            "content": f"Error: {text}" if block.get("is_error") else text})
        elif kind == "thinking" and role == "assistant":
            if not isinstance(block.get("thinking"), str):
                raise bad_request(f"{at}.thinking must be a string", f"{at}.thinking")
            thoughts.append(block["thinking"])
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # encrypted by another server: nothing a local model can read
        else:
            texts.append(_text_block(block, at))
    if role == "user":
        return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    if thoughts:
        msg["reasoning_content"] = "".join(thoughts)
    return [msg]


def _messages(body: dict) -> list[dict[str, Any]]:
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
    if msgs[-1].get("role") != "user":
        raise bad_request("the last message must have role 'user' (assistant prefill is not supported)",
                          f"messages[{len(msgs) - 1}].role")
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
    unknown = sorted(set(body) - _FIELDS - _IGNORED)
    if unknown:
        raise bad_request(f"{unknown[0]}: Extra inputs are not permitted", unknown[0])
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model: Field required (a non-empty string)", "model")
    req = GenerationRequest(model=model, messages=_messages(body))
    req.tools = parse_tool_list(body.get("tools"), _anthropic_tool)
    req.tool_choice, req.parallel_tool_calls = _tool_choice(body.get("tool_choice"), req.tools)
    req.think = _thinking(body.get("thinking"))
    req.constraint = _output_format(body.get("output_config"))
    # harmony's Reasoning: level (gpt-oss): output_config.effort, else the thinking budget in tokens
    effort = (body.get("output_config") or {}).get("effort") or (body.get("thinking") or {}).get("budget_tokens")
    if effort is not None:
        req.template_kwargs["reasoning_effort"] = effort
    if req.constraint is not None and req.tool_choice not in ("none", "auto"):
        raise bad_request("output_config.format cannot be combined with tool_choice 'any' or 'tool'",
                          "output_config.format")
    mt = _number(body, "max_tokens", integer=True)
    if mt is None or mt < 1:
        raise bad_request("max_tokens: Field required (a positive integer)", "max_tokens")
    req.max_tokens = mt
    temp = _number(body, "temperature")
    if temp is not None:
        if not 0 <= temp <= 1:
            raise bad_request(f"temperature: must be between 0 and 1, got {temp}", "temperature")
        req.sampling["temperature"] = temp
    top_p = _number(body, "top_p")
    if top_p is not None:
        req.sampling["top_p"] = top_p
    top_k = _number(body, "top_k", integer=True)
    if top_k is not None:
        if not 0 <= top_k < 2**31:  # past the vocabulary it means no limit; huge values must not reach tensors
            raise bad_request(f"top_k: must be between 0 and {2**31 - 1}, got {top_k}", "top_k")
        req.sampling["top_k"] = top_k
    req.sampling["stop"] = _stop(body.get("stop_sequences"), "stop_sequences")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream: must be true or false", "stream")
    req.stream = stream
    return req


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
    st = server_state(request)
    req = parse_messages_request(parse_json_object(await request.body()))
    mid = f"msg_{request.state.request_id}{secrets.token_hex(4)}"
    if req.stream:
        if not is_loaded(st.manager, req.model):
            return EventSourceResponse(stream_after_load(request, req, "messages", lambda g: _events(g, mid),
                                                         _error_event, {"event": "ping",
                                                                        "data": json.dumps({"type": "ping"})},
                                                         _CONSTRAINT_PARAM), ping=15, send_timeout=30)
        gen = await start_generation(request, req, "messages", _CONSTRAINT_PARAM)
        return EventSourceResponse(_events(gen, mid), ping=15, send_timeout=30,
                                   background=BackgroundTask(gen.aclose))
    gen = await start_generation(request, req, "messages", _CONSTRAINT_PARAM)
    results = await gen.collect_unless_disconnected(request)
    if results is None:
        return Response(status_code=499)
    r = results[0]
    reason, seq = _stop_fields(r.finish_reason, r.stop_reason, req.sampling["stop"])
    return JSONResponse({"id": mid, "type": "message", "role": "assistant", "model": gen.model,
                         "content": content_blocks(r), "stop_reason": reason, "stop_sequence": seq,
                         "usage": _usage(gen, r.num_output_tokens)})


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


async def _events(gen: Generation, mid: str) -> AsyncIterator[dict]:
    """message_start, then per content block (thinking, text, tool_use) content_block_start, its deltas
    (thinking_delta, text_delta, input_json_delta) and content_block_stop, then message_delta, message_stop."""
    start_usage = {"input_tokens": gen.prompt_lens[0] if gen.prompt_lens else 0, "output_tokens": 0,
                   "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    blocks = _Blocks()
    try:
        yield _event("message_start", message={"id": mid, "type": "message", "role": "assistant", "model": gen.model,
                                               "content": [], "stop_reason": None, "stop_sequence": None,
                                               "usage": start_usage})
        last = None
        async for _, out in gen.outputs():
            if out.reasoning:
                for e in blocks.ensure("thinking"):
                    yield e
                yield _event("content_block_delta", index=blocks.index,
                             delta={"type": "thinking_delta", "thinking": out.reasoning})
            if out.text:
                for e in blocks.ensure("text"):
                    yield e
                yield _event("content_block_delta", index=blocks.index, delta={"type": "text_delta", "text": out.text})
            last = out
        calls = (last.tool_calls if last else None) or []
        if blocks.index < 0 and not calls:  # an empty reply still has its (empty) text block
            for e in blocks.ensure("text"):
                yield e
        for call in calls:
            block = tool_use_block(call)
            for e in blocks.start({**block, "input": {}}):
                yield e
            yield _event("content_block_delta", index=blocks.index,
                         delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"],
                                                                                       ensure_ascii=False)})
        for e in blocks.close():
            yield e
        reason, seq = _stop_fields(last.finish_reason if last else None, last.stop_reason if last else None,
                                   gen.req.sampling.get("stop", []))
        n_out = last.num_output_tokens if last else 0
        yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": seq},
                     usage={"output_tokens": n_out, **{k: v for k, v in _usage(gen, n_out).items()
                                                       if k != "output_tokens"}})
        yield _event("message_stop")
    except Exception as e:  # after the stream started: Anthropic's error event
        yield _error_event(from_exception(e, gen.request_id))
    finally:
        gen.close()


@api_errors
async def count_tokens(request: Request) -> Response:
    """POST /v1/messages/count_tokens: the prompt's token count through the model's chat template."""
    st = server_state(request)
    body = parse_json_object(await request.body())
    req = parse_messages_request({**body, "max_tokens": 1, "stream": False})
    lease = await st.manager.acquire(req.model)
    try:
        gen = Generation(lease, req, st.metrics, request.state.request_id, "messages")
        if getattr(lease.engine, "is_embedding", False):
            raise APIError(400, f"model {lease.entry.id!r} is an embedding model", "invalid_request_error", "model")
        n = len(gen.prompt_ids()[0])
    finally:
        lease.release()
    return JSONResponse({"input_tokens": n})


ROUTES = [
    Route("/v1/messages", messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]
