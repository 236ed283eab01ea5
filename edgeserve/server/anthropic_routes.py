"""Anthropic Messages API: POST /v1/messages (JSON or SSE with Anthropic's event sequence) and
POST /v1/messages/count_tokens, translated into a GenerationRequest and back. Errors use Anthropic's shape
(errors.error_body picks it by path)."""

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
from edgeserve.server.generation import Generation
from edgeserve.server.loading import is_loaded, stream_after_load
from edgeserve.server.schemas import GenerationRequest, _number, _stop, parse_json_object
from edgeserve.server.state import api_errors, server_state

_FIELDS = {"model", "messages", "system", "max_tokens", "temperature", "top_p", "top_k", "stop_sequences",
           "stream", "tools", "tool_choice", "thinking", "output_config"}
# accepted and changing nothing about the reply (bookkeeping, routing and caching hints)
_IGNORED = {"metadata", "service_tier", "cache_control", "inference_geo", "speed", "diagnostics", "workspace_id",
            "user_profile_id"}
_BLOCK_KEYS = {"type", "text", "cache_control", "citations"}


def _text(content: Any, where: str) -> str:
    """A string, or a list of text blocks joined; any other block type is a 400 naming it."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content blocks", where)
    parts = []
    for j, block in enumerate(content):
        here = f"{where}[{j}]"
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise bad_request(f"{here}: content block type {kind!r} is not supported (only 'text')", here)
        if not isinstance(block.get("text"), str):
            raise bad_request(f"{here}.text must be a string", f"{here}.text")
        extra = set(block) - _BLOCK_KEYS
        if extra:
            raise bad_request(f"{here}.{sorted(extra)[0]} is not supported", f"{here}.{sorted(extra)[0]}")
        parts.append(block["text"])
    return "".join(parts)


def _messages(body: dict) -> list[dict[str, str]]:
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
        out.append({"role": m["role"], "content": _text(m.get("content"), f"{here}.content")})
    if out[-1]["role"] != "user":
        raise bad_request("the last message must have role 'user' (assistant prefill is not supported)",
                          f"messages[{len(msgs) - 1}].role")
    return out


def parse_messages_request(body: dict) -> GenerationRequest:
    """Validate a POST /v1/messages body into a GenerationRequest (400 naming the field otherwise)."""
    unknown = sorted(set(body) - _FIELDS - _IGNORED)
    if unknown:
        raise bad_request(f"{unknown[0]}: Extra inputs are not permitted", unknown[0])
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model: Field required (a non-empty string)", "model")
    if body.get("tools") not in (None, []) or body.get("tool_choice") is not None:
        name = "tools" if body.get("tools") not in (None, []) else "tool_choice"
        raise bad_request(f"{name}: tool use is not supported by this server yet", name)
    if body.get("thinking") not in (None, {"type": "disabled"}):
        raise bad_request("thinking: extended thinking is not supported", "thinking")
    if body.get("output_config") not in (None, {}):
        raise bad_request("output_config: structured output and effort settings are not supported", "output_config")
    req = GenerationRequest(model=model, messages=_messages(body))
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
    if isinstance(stop_reason, str) and stop_reason in stops:
        return "stop_sequence", stop_reason
    return "end_turn", None


def _usage(gen: Generation, output_tokens: int) -> dict[str, int]:
    """Anthropic usage: input_tokens are the prompt tokens computed, cache_read_input_tokens those reused."""
    prompt = gen.usage.prompt_tokens or (gen.prompt_lens[0] if gen.prompt_lens else 0)
    cached = gen.usage.cached_tokens
    return {"input_tokens": prompt - cached, "output_tokens": output_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached}


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
                                                                        "data": json.dumps({"type": "ping"})}),
                                       ping=15, send_timeout=30)
        gen = await _start(request, req)
        return EventSourceResponse(_events(gen, mid), ping=15, send_timeout=30,
                                   background=BackgroundTask(gen.aclose))
    gen = await _start(request, req)
    results = await gen.collect_unless_disconnected(request)
    if results is None:
        return Response(status_code=499)
    r = results[0]
    reason, seq = _stop_fields(r.finish_reason, r.stop_reason, req.sampling["stop"])
    return JSONResponse({"id": mid, "type": "message", "role": "assistant", "model": gen.model,
                         "content": [{"type": "text", "text": r.text}], "stop_reason": reason, "stop_sequence": seq,
                         "usage": _usage(gen, r.num_output_tokens)})


async def _start(request: Request, req: GenerationRequest) -> Generation:
    st = server_state(request)
    lease = await st.manager.acquire(req.model)
    gen = Generation(lease, req, st.metrics, request.state.request_id, "messages")
    gen.submit()
    return gen


def _event(kind: str, **data: Any) -> dict:
    return {"event": kind, "data": json.dumps({"type": kind, **data}, ensure_ascii=False)}


def _error_event(err: APIError) -> dict:
    return {"event": "error", "data": json.dumps(anthropic_error_body(err), ensure_ascii=False)}


async def _events(gen: Generation, mid: str) -> AsyncIterator[dict]:
    """message_start, content_block_start, content_block_delta*, content_block_stop, message_delta, message_stop."""
    start_usage = {"input_tokens": gen.prompt_lens[0] if gen.prompt_lens else 0, "output_tokens": 0,
                   "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    try:
        yield _event("message_start", message={"id": mid, "type": "message", "role": "assistant", "model": gen.model,
                                               "content": [], "stop_reason": None, "stop_sequence": None,
                                               "usage": start_usage})
        yield _event("content_block_start", index=0, content_block={"type": "text", "text": ""})
        yield _event("ping")
        last = None
        async for _, out in gen.outputs():
            if out.text:
                yield _event("content_block_delta", index=0, delta={"type": "text_delta", "text": out.text})
            last = out
        yield _event("content_block_stop", index=0)
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
