"""OpenAI Responses API, stateless: POST /v1/responses (JSON or SSE with the response.* events), translated
into a GenerationRequest and back. Nothing is stored, so `previous_response_id` is refused with a 400.

Function tools, tool_choice, parallel_tool_calls, text.format and reasoning.effort map onto the chat route's
fields (tools, tool_choice, constraint, think; see chat_setup); function_call / function_call_output / reasoning
input items become the chat messages' tool_calls, tool messages and reasoning_content. The output is a
reasoning item (where the model thinks), a message item and a function_call item per call."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any, AsyncIterator

from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edgeserve.server.errors import APIError, bad_request, from_exception
from edgeserve.server.generation import ChoiceResult, Generation
from edgeserve.server.loading import is_loaded, start_generation, stream_after_load
from edgeserve.server.schemas import GenerationRequest, _number, parse_json_object
from edgeserve.server.state import api_errors, server_state
from edgeserve.server.tool_schemas import function_tool, parse_tool_list, set_tools
from edgeserve.text.grammar import GrammarSpec
from edgeserve.text.tool_calls import ToolCall

_FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream",
           "previous_response_id", "text", "tools", "tool_choice", "parallel_tool_calls", "reasoning", "include",
           "truncation", "conversation", "prompt", "background", "top_logprobs", "stream_options"}
_IGNORED = {"store", "metadata", "user", "service_tier", "safety_identifier", "prompt_cache_key"}
_ROLES = {"user", "assistant", "system", "developer"}
_TEXT_PARTS = {"input_text", "output_text", "text"}
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_INCLUDE = {"reasoning.encrypted_content"}


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", where)
    out = []
    for j, part in enumerate(content):
        here = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{here}: content part type {kind!r} is not supported (only input_text / "
                              "output_text)", here)
        out.append(part["text"])
    return "".join(out)


def _item_string(item: dict, key: str, here: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{here}.{key} is required and must be a non-empty string", f"{here}.{key}")
    return value


def _input_messages(value: Any) -> list[dict[str, Any]]:
    """`input` as chat messages: message items as they are; function_call items become the assistant message's
    `tool_calls`, function_call_output items tool messages, reasoning items the next assistant message's
    `reasoning_content`."""
    if isinstance(value, str):
        if not value:
            raise bad_request("input must not be empty", "input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("input is required: a string or a non-empty list of input items", "input")
    out: list[dict[str, Any]] = []
    thought: str | None = None  # a reasoning item waiting for its assistant message
    for i, item in enumerate(value):
        here = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{here} must be an object", here)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad_request(f"{here}.role must be one of user, assistant, system, developer; got {role!r}",
                                  f"{here}.role")
            extra = set(item) - {"type", "role", "content", "id", "status", "phase"}
            if extra:
                raise bad_request(f"{here}.{sorted(extra)[0]} is not supported", f"{here}.{sorted(extra)[0]}")
            msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                   "content": _content(item.get("content"), f"{here}.content")}
            if role == "assistant" and thought is not None:
                msg["reasoning_content"], thought = thought, None
            out.append(msg)
        elif kind == "function_call":
            args = _item_string(item, "arguments", here) if item.get("arguments") != "" else "{}"
            try:
                json.loads(args)
            except json.JSONDecodeError:
                raise bad_request(f"{here}.arguments is not valid JSON", f"{here}.arguments") from None
            call = {"id": _item_string(item, "call_id", here), "type": "function",
                    "function": {"name": _item_string(item, "name", here), "arguments": args}}
            if not out or out[-1]["role"] != "assistant":  # calls without text: an assistant turn of their own
                out.append({"role": "assistant", "content": ""})
            if thought is not None:
                out[-1]["reasoning_content"], thought = thought, None
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _item_string(item, "call_id", here),
                        "content": _content(item.get("output"), f"{here}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list):
                raise bad_request(f"{here}.content must be a list of reasoning_text parts", f"{here}.content")
            thought = "".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
        else:
            raise bad_request(f"{here}.type {kind!r} is not supported (message, function_call, function_call_output "
                              "and reasoning items are)", f"{here}.type")
    return out


def _refuse_unless(body: dict, key: str, allowed: tuple, why: str) -> None:
    if body.get(key) not in allowed:
        raise bad_request(f"{key} {why}", key, "unsupported_parameter")


def _responses_tool(tool: Any, here: str) -> dict:
    """A Responses function tool ({"type": "function", name, description?, parameters?, strict?}) in the OpenAI
    chat tools shape; built-in tools (web search, file search, ...) are a 400."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise bad_request(f"{here}.type {kind!r} is not supported (only function tools)", f"{here}.type",
                          "unsupported_parameter")
    return function_tool(tool, here)


def _text_format(text: Any) -> GrammarSpec | None:
    """`text.format`: text, json_object, or json_schema ({name, schema, strict?, description?}) as a grammar."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise bad_request("text must be an object with format and/or verbosity", "text")
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format.schema must be a JSON schema object", "text.format.schema")
        return GrammarSpec.json_schema(fmt["schema"])
    raise bad_request(f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", "text.format")


def _reasoning(value: Any) -> bool | None:
    """`reasoning.effort`: "none" turns the template's reasoning off, any other effort on; absent: its default."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"effort", "summary", "generate_summary", "context", "mode"}:
        raise bad_request("reasoning must be an object with effort and/or summary", "reasoning")
    effort = value.get("effort")
    if effort not in (None, *_EFFORTS):
        raise bad_request(f"reasoning.effort must be one of {', '.join(_EFFORTS)}", "reasoning.effort")
    return None if effort is None else effort != "none"


def parse_responses_request(body: dict) -> GenerationRequest:
    """Validate a POST /v1/responses body into a GenerationRequest (400 naming the field otherwise)."""
    unknown = sorted(set(body) - _FIELDS - _IGNORED)
    if unknown:
        raise bad_request(f"unsupported field {unknown[0]!r}", unknown[0], "unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model is required and must be a non-empty string", "model")
    _refuse_unless(body, "previous_response_id", (None,),
                   "is not supported: this server stores no responses; send the whole conversation as input items")
    _refuse_unless(body, "conversation", (None,), "is not supported: this server stores no conversations")
    _refuse_unless(body, "prompt", (None,), "(stored prompt templates) is not supported")
    _refuse_unless(body, "background", (None, False), "is not supported")
    include = body.get("include")
    if include is not None and (not isinstance(include, list)
                                or not all(isinstance(x, str) and x in _INCLUDE for x in include)):
        raise bad_request(f"include may only list {', '.join(sorted(_INCLUDE))} (accepted; nothing is encrypted)",
                          "include", "unsupported_parameter")
    _refuse_unless(body, "top_logprobs", (None, 0), "is not supported")
    _refuse_unless(body, "truncation", (None, "disabled"), "must be 'disabled' (a prompt past the context is a 400)")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions must be a string", "instructions")
    msgs = _input_messages(body.get("input"))
    if instructions:
        msgs = [{"role": "system", "content": instructions}, *msgs]
    req = GenerationRequest(model=model, messages=msgs)
    req.constraint = _text_format(body.get("text"))
    set_tools(req, parse_tool_list(body.get("tools"), _responses_tool), body, "text.format")
    req.think = _reasoning(body.get("reasoning"))
    if req.think is not None:  # harmony's Reasoning: level (gpt-oss)
        req.template_kwargs["reasoning_effort"] = body["reasoning"]["effort"]
    mt = _number(body, "max_output_tokens", integer=True)
    if mt is not None and mt < 1:
        raise bad_request(f"max_output_tokens must be a positive integer, got {mt}", "max_output_tokens")
    req.max_tokens = mt
    for key in ("temperature", "top_p"):
        v = _number(body, key)
        if v is not None:
            req.sampling[key] = v
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream must be true or false", "stream")
    req.stream = stream
    if body.get("stream_options") is not None and not stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    return req


class _Reply:
    """The output items and response object of one request, built up as the reply arrives."""

    def __init__(self, gen: Generation, body: dict, rid: str) -> None:
        self.gen, self.body, self.id = gen, body, rid
        self.created = int(time.time())
        self.items: list[dict] = []  # output items, finished or in progress

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}_{secrets.token_hex(12)}"

    @staticmethod
    def message(item_id: str, text: str | None, status: str) -> dict:
        """A message item (no content part while `text` is None: just added)."""
        content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def reasoning(item_id: str, text: str | None, status: str) -> dict:
        """A reasoning item: the model's thought as reasoning_text (no summary is written)."""
        content = [] if text is None else [{"type": "reasoning_text", "text": text}]
        return {"type": "reasoning", "id": item_id, "status": status, "summary": [], "content": content,
                "encrypted_content": None}

    @staticmethod
    def function_call(item_id: str, call: ToolCall, arguments: str, status: str) -> dict:
        """A function_call item (call_id is the call's id, which function_call_output items name)."""
        return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
                "arguments": arguments, "status": status}

    def items_of(self, r: ChoiceResult) -> list[dict]:
        """A finished reply's output: reasoning, the message (unless the reply is only calls), function calls."""
        status = "incomplete" if r.finish_reason == "length" else "completed"
        items = []
        if r.reasoning:
            items.append(self.reasoning(self.new_id("rs"), r.reasoning, status))
        if r.text or not r.tool_calls:
            items.append(self.message(self.new_id("msg"), r.text, status))
        return items + [self.function_call(self.new_id("fc"), c, c.arguments, "completed") for c in r.tool_calls]

    def response(self, status: str, finish: str | None = None, n_out: int = 0, reasoning: str = "") -> dict:
        """The response object; when done, `self.items` is its output and usage is filled in."""
        done = status != "in_progress"
        usage = None
        if done:
            u = self.gen.usage
            thought = len(self.gen.lease.lm.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
            usage = {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
                     "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": min(thought, n_out)},
                     "total_tokens": u.prompt_tokens + n_out}
        text = self.body.get("text") or {}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
                "instructions": self.body.get("instructions"), "max_output_tokens": self.body.get("max_output_tokens"),
                "model": self.gen.model, "output": self.items if done else [],
                "parallel_tool_calls": self.body.get("parallel_tool_calls", True),
                "previous_response_id": None, "reasoning": {"effort": (self.body.get("reasoning") or {}).get("effort"),
                                                            "summary": None},
                "store": False, "temperature": self.body.get("temperature", 1.0),
                "text": {"format": text.get("format") or {"type": "text"}},
                "tool_choice": self.body.get("tool_choice", "auto"), "tools": self.body.get("tools") or [],
                "top_p": self.body.get("top_p", 1.0), "truncation": "disabled", "usage": usage,
                "metadata": self.body.get("metadata") or {}}


@api_errors
async def responses(request: Request) -> Response:
    """POST /v1/responses (stateless)."""
    st = server_state(request)
    body = parse_json_object(await request.body())
    req = parse_responses_request(body)
    rid = f"resp_{request.state.request_id}{secrets.token_hex(4)}"
    if req.stream:
        if not is_loaded(st.manager, req.model):
            return EventSourceResponse(stream_after_load(request, req, "input", lambda g: _events(g, body, rid),
                                                         _error_event, {"comment": "loading model"}, "text.format"),
                                       ping=15, send_timeout=30)
        gen = await start_generation(request, req, "input", "text.format")
        return EventSourceResponse(_events(gen, body, rid), ping=15, send_timeout=30,
                                   background=BackgroundTask(gen.aclose))
    gen = await start_generation(request, req, "input", "text.format")
    results = await gen.collect_unless_disconnected(request)
    if results is None:
        return Response(status_code=499)
    r = results[0]
    reply = _Reply(gen, body, rid)
    reply.items = reply.items_of(r)
    status = "incomplete" if r.finish_reason == "length" else "completed"
    return JSONResponse(reply.response(status, r.finish_reason, r.num_output_tokens, r.reasoning))


def _error_event(err: APIError, seq: int = 0) -> dict:
    return {"event": "error", "data": json.dumps({"type": "error", "code": err.code, "message": err.message,
                                                  "param": err.param, "sequence_number": seq})}


async def _events(gen: Generation, body: dict, rid: str) -> AsyncIterator[dict]:
    """response.created, response.in_progress, then per output item (reasoning, message, function_call)
    output_item.added, its parts and deltas (reasoning_text.*, content_part.* with output_text.*,
    function_call_arguments.*) and output_item.done; then response.completed (or .incomplete)."""
    reply = _Reply(gen, body, rid)
    seq = 0

    def event(kind: str, **data: Any) -> dict:
        nonlocal seq
        seq += 1
        return {"event": kind, "data": json.dumps({"type": kind, "sequence_number": seq - 1, **data},
                                                  ensure_ascii=False)}

    open_kind: str | None = None  # "reasoning" / "message": the item taking deltas
    texts = {"reasoning": "", "message": ""}

    def part(kind: str, text: str) -> dict:
        return {"type": "reasoning_text", "text": text} if kind == "reasoning" else \
            {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def where() -> dict:
        return {"item_id": reply.items[-1]["id"], "output_index": len(reply.items) - 1, "content_index": 0}

    def start(kind: str) -> list[dict]:
        nonlocal open_kind
        out = finish("completed")
        open_kind = kind
        item_id = reply.new_id("rs" if kind == "reasoning" else "msg")
        reply.items.append(getattr(reply, kind)(item_id, None, "in_progress"))
        out.append(event("response.output_item.added", output_index=len(reply.items) - 1, item=reply.items[-1]))
        out.append(event("response.content_part.added", **where(), part=part(kind, "")))
        return out

    def finish(status: str) -> list[dict]:
        nonlocal open_kind
        if open_kind is None:
            return []
        kind, text = open_kind, texts[open_kind]
        open_kind = None
        done = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        out = [event(done, **where(), text=text, **extra),
               event("response.content_part.done", **where(), part=part(kind, text))]
        reply.items[-1] = getattr(reply, kind)(reply.items[-1]["id"], text, status)
        out.append(event("response.output_item.done", output_index=len(reply.items) - 1, item=reply.items[-1]))
        return out

    try:
        yield event("response.created", response=reply.response("in_progress"))
        yield event("response.in_progress", response=reply.response("in_progress"))
        last = None
        async for _, out in gen.outputs():
            for kind, piece in (("reasoning", out.reasoning), ("message", out.text)):
                if not piece:
                    continue
                if open_kind != kind:
                    for e in start(kind):
                        yield e
                texts[kind] += piece
                delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
                yield event(delta, **where(), delta=piece, **({} if kind == "reasoning" else {"logprobs": []}))
            last = out
        finish_reason = last.finish_reason if last else None
        status = "incomplete" if finish_reason == "length" else "completed"
        calls = (last.tool_calls if last else None) or []
        if not reply.items and not calls:  # an empty reply still has its (empty) message
            for e in start("message"):
                yield e
        for e in finish(status):
            yield e
        for call in calls:
            item_id = reply.new_id("fc")
            reply.items.append(reply.function_call(item_id, call, "", "in_progress"))
            index = len(reply.items) - 1
            yield event("response.output_item.added", output_index=index, item=reply.items[-1])
            yield event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                        delta=call.arguments)
            yield event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                        arguments=call.arguments, name=call.name)
            reply.items[-1] = reply.function_call(item_id, call, call.arguments, "completed")
            yield event("response.output_item.done", output_index=index, item=reply.items[-1])
        n_out = last.num_output_tokens if last else 0
        yield event(f"response.{status}", response=reply.response(status, finish_reason, n_out, texts["reasoning"]))
    except Exception as e:  # after the stream started: an error event ends it
        yield _error_event(from_exception(e, gen.request_id), seq)
    finally:
        gen.close()


ROUTES = [Route("/v1/responses", responses, methods=["POST"])]
