"""OpenAI Responses API, stateless: POST /v1/responses (JSON or SSE with the response.* events), translated
into a GenerationRequest and back. Nothing is stored, so `previous_response_id` is refused with a 400."""

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
from edgeserve.server.generation import Generation
from edgeserve.server.loading import is_loaded, stream_after_load
from edgeserve.server.schemas import GenerationRequest, _number, parse_json_object
from edgeserve.server.state import api_errors, server_state

_FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream",
           "previous_response_id", "text", "tools", "tool_choice", "parallel_tool_calls", "reasoning", "include",
           "truncation", "conversation", "prompt", "background", "top_logprobs", "stream_options"}
_IGNORED = {"store", "metadata", "user", "service_tier", "safety_identifier", "prompt_cache_key"}
_ROLES = {"user", "assistant", "system", "developer"}
_TEXT_PARTS = {"input_text", "output_text", "text"}


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


def _input_messages(value: Any) -> list[dict[str, str]]:
    if isinstance(value, str):
        if not value:
            raise bad_request("input must not be empty", "input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("input is required: a string or a non-empty list of input items", "input")
    out = []
    for i, item in enumerate(value):
        here = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{here} must be an object", here)
        kind = item.get("type", "message")
        if kind != "message":
            raise bad_request(f"{here}.type {kind!r} is not supported (only message items; function calls and "
                              "reasoning items are not implemented)", f"{here}.type")
        role = item.get("role")
        if role not in _ROLES:
            raise bad_request(f"{here}.role must be one of user, assistant, system, developer; got {role!r}",
                              f"{here}.role")
        extra = set(item) - {"type", "role", "content", "id", "status"}
        if extra:
            raise bad_request(f"{here}.{sorted(extra)[0]} is not supported", f"{here}.{sorted(extra)[0]}")
        out.append({"role": "system" if role == "developer" else role,
                    "content": _content(item.get("content"), f"{here}.content")})
    return out


def _refuse_unless(body: dict, key: str, allowed: tuple, why: str) -> None:
    if body.get(key) not in allowed:
        raise bad_request(f"{key} {why}", key, "unsupported_parameter")


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
    _refuse_unless(body, "tools", (None, []), "(function and built-in tools) is not supported yet")
    _refuse_unless(body, "tool_choice", (None, "none", "auto"), "is not supported (no tools)")
    _refuse_unless(body, "reasoning", (None, {}), "is not supported")
    _refuse_unless(body, "include", (None, []), "is not supported")
    _refuse_unless(body, "top_logprobs", (None, 0), "is not supported")
    _refuse_unless(body, "truncation", (None, "disabled"), "must be 'disabled' (a prompt past the context is a 400)")
    text = body.get("text")
    if text is not None:
        fmt = text.get("format") if isinstance(text, dict) else None
        if not isinstance(text, dict) or set(text) - {"format", "verbosity"} or fmt not in (None, {"type": "text"}):
            raise bad_request("text.format other than {\"type\": \"text\"} (structured output) is not supported",
                              "text.format", "unsupported_parameter")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions must be a string", "instructions")
    msgs = _input_messages(body.get("input"))
    if instructions:
        msgs = [{"role": "system", "content": instructions}, *msgs]
    req = GenerationRequest(model=model, messages=msgs)
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
    """The response object of one request, built up as the text arrives."""

    def __init__(self, gen: Generation, body: dict, rid: str) -> None:
        self.gen, self.body, self.id = gen, body, rid
        self.msg_id = f"msg_{secrets.token_hex(12)}"
        self.created = int(time.time())

    def message(self, text: str, status: str) -> dict:
        content = [] if status == "in_progress" else [{"type": "output_text", "text": text, "annotations": [],
                                                       "logprobs": []}]
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant", "content": content}

    def response(self, status: str, text: str = "", finish: str | None = None, n_out: int = 0) -> dict:
        done = status != "in_progress"
        usage = None
        if done:
            u = self.gen.usage
            usage = {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
                     "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": u.prompt_tokens + n_out}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
                "instructions": self.body.get("instructions"), "max_output_tokens": self.body.get("max_output_tokens"),
                "model": self.gen.model, "output": [self.message(text, "completed" if finish != "length"
                                                                 else "incomplete")] if done else [],
                "parallel_tool_calls": self.body.get("parallel_tool_calls", True),
                "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
                "store": False, "temperature": self.body.get("temperature", 1.0), "text": {"format": {"type": "text"}},
                "tool_choice": self.body.get("tool_choice", "auto"), "tools": [], "top_p": self.body.get("top_p", 1.0),
                "truncation": "disabled", "usage": usage, "metadata": self.body.get("metadata") or {}}


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
                                                         _error_event, {"comment": "loading model"}),
                                       ping=15, send_timeout=30)
        gen = await _start(request, req)
        return EventSourceResponse(_events(gen, body, rid), ping=15, send_timeout=30,
                                   background=BackgroundTask(gen.aclose))
    gen = await _start(request, req)
    results = await gen.collect_unless_disconnected(request)
    if results is None:
        return Response(status_code=499)
    r = results[0]
    reply = _Reply(gen, body, rid)
    status = "incomplete" if r.finish_reason == "length" else "completed"
    return JSONResponse(reply.response(status, r.text, r.finish_reason, r.num_output_tokens))


async def _start(request: Request, req: GenerationRequest) -> Generation:
    st = server_state(request)
    lease = await st.manager.acquire(req.model)
    gen = Generation(lease, req, st.metrics, request.state.request_id, "input")
    gen.submit()
    return gen


def _error_event(err: APIError, seq: int = 0) -> dict:
    return {"event": "error", "data": json.dumps({"type": "error", "code": err.code, "message": err.message,
                                                  "param": err.param, "sequence_number": seq})}


async def _events(gen: Generation, body: dict, rid: str) -> AsyncIterator[dict]:
    """response.created, in_progress, output_item.added, content_part.added, output_text.delta*,
    output_text.done, content_part.done, output_item.done, then response.completed (or .incomplete)."""
    reply = _Reply(gen, body, rid)
    seq = 0

    def event(kind: str, **data: Any) -> dict:
        nonlocal seq
        seq += 1
        return {"event": kind, "data": json.dumps({"type": kind, "sequence_number": seq - 1, **data},
                                                  ensure_ascii=False)}

    where = {"item_id": reply.msg_id, "output_index": 0, "content_index": 0}
    try:
        yield event("response.created", response=reply.response("in_progress"))
        yield event("response.in_progress", response=reply.response("in_progress"))
        yield event("response.output_item.added", output_index=0, item=reply.message("", "in_progress"))
        yield event("response.content_part.added", **where,
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        text, last = "", None
        async for _, out in gen.outputs():
            if out.text:
                text += out.text
                yield event("response.output_text.delta", **where, delta=out.text, logprobs=[])
            last = out
        finish = last.finish_reason if last else None
        n_out = last.num_output_tokens if last else 0
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        yield event("response.output_text.done", **where, text=text, logprobs=[])
        yield event("response.content_part.done", **where, part=part)
        item_status = "incomplete" if finish == "length" else "completed"
        yield event("response.output_item.done", output_index=0, item=reply.message(text, item_status))
        status = "incomplete" if finish == "length" else "completed"
        yield event(f"response.{status}", response=reply.response(status, text, finish, n_out))
    except Exception as e:  # after the stream started: an error event ends it
        yield _error_event(from_exception(e, gen.request_id), seq)
    finally:
        gen.close()


ROUTES = [Route("/v1/responses", responses, methods=["POST"])]
