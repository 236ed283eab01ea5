"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions (JSON or SSE)."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edgeserve.engine.outputs import TokenLogprob
from edgeserve.server.errors import APIError, from_exception
from edgeserve.server.generation import ChoiceResult, Generation
from edgeserve.server.loading import is_loaded, start_generation, stream_after_load
from edgeserve.server.schemas import GenerationRequest, parse_chat_request, parse_completion_request, read_request
from edgeserve.server.state import api_errors, server_state


async def list_models(request: Request) -> Response:
    """GET /v1/models: the configured models and pulled catalog models."""
    st = server_state(request)
    data = [{"id": mid, "object": "model", "created": st.started, "owned_by": "edgeserve"}
            for mid in st.manager.known()]
    return JSONResponse({"object": "list", "data": data})


def _token_entry(gen: Generation, token_id: int, logprob: float) -> dict[str, Any]:
    text = gen.token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(gen: Generation, lps: list[TokenLogprob] | None) -> dict | None:
    """OpenAI chat `logprobs` for some tokens: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    if not gen.req.logprobs or lps is None:
        return None
    return {"content": [{**_token_entry(gen, lp.token_id, lp.logprob),
                         "top_logprobs": [_token_entry(gen, t, v) for t, v in lp.top]} for lp in lps]}


def completion_logprobs(gen: Generation, lps: list[TokenLogprob] | None, offset: int = 0) -> dict | None:
    """OpenAI completions `logprobs`: tokens, token_logprobs, top_logprobs, text_offset."""
    if gen.req.sampling.get("logprobs") is None or lps is None:
        return None
    tokens = [gen.token_text(lp.token_id) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{gen.token_text(t): v for t, v in lp.top} for lp in lps], "text_offset": offsets}


@api_errors
async def chat_completions(request: Request) -> Response:
    """POST /v1/chat/completions."""
    st = server_state(request)
    req = await read_request(request, lambda body: parse_chat_request(body, st.config.max_n))
    rid = f"chatcmpl-{request.state.request_id}"
    if req.stream and not is_loaded(st.manager, req.model):
        return _sse_after_load(request, req, "messages", lambda g: _chat_events(g, rid))
    gen = await start_generation(request, req, "messages")
    if req.stream:
        return EventSourceResponse(_chat_events(gen, rid), ping=15, send_timeout=30,
                                   background=BackgroundTask(gen.aclose))
    results = await gen.collect_unless_disconnected(request)
    if results is None:
        return Response(status_code=499)  # the client is gone; nothing is sent
    choices = [{"index": r.index, "message": chat_message(r), "logprobs": chat_logprobs(gen, r.logprobs),
                "finish_reason": _finish(r)} for r in results]
    return JSONResponse({"id": rid, "object": "chat.completion", "created": gen.created, "model": gen.model,
                         "choices": choices, "usage": gen.usage.as_openai(), "system_fingerprint": None})


@api_errors
async def completions(request: Request) -> Response:
    """POST /v1/completions."""
    st = server_state(request)
    req = await read_request(request, lambda body: parse_completion_request(body, st.config.max_n))
    rid = f"cmpl-{request.state.request_id}"
    if req.stream and not is_loaded(st.manager, req.model):
        return _sse_after_load(request, req, "prompt", lambda g: _completion_events(g, rid))
    gen = await start_generation(request, req, "prompt")
    if req.stream:
        return EventSourceResponse(_completion_events(gen, rid), ping=15, send_timeout=30,
                                   background=BackgroundTask(gen.aclose))
    results = await gen.collect_unless_disconnected(request)
    if results is None:
        return Response(status_code=499)  # the client is gone; nothing is sent
    choices = [{"index": r.index, "text": r.text, "logprobs": completion_logprobs(gen, r.logprobs),
                "finish_reason": _finish(r)} for r in results]
    return JSONResponse({"id": rid, "object": "text_completion", "created": gen.created, "model": gen.model,
                         "choices": choices, "usage": gen.usage.as_openai(), "system_fingerprint": None})


def openai_error_event(err: APIError) -> dict:
    """An error after an SSE stream started, in OpenAI's shape."""
    return _data({"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}})


def _sse_after_load(request: Request, req: GenerationRequest, prompt_param: str, events) -> Response:
    """Send the headers now and `: loading model` comments until the model is loaded, then the stream."""
    return EventSourceResponse(stream_after_load(request, req, prompt_param, events, openai_error_event,
                                                 {"comment": "loading model"}), ping=15, send_timeout=30)


def chat_message(r: ChoiceResult) -> dict[str, Any]:
    """The assistant message of a choice: content, reasoning (`reasoning_content`, also as `reasoning`) and
    `tool_calls` (content is null when the reply is only calls)."""
    msg: dict[str, Any] = {"role": "assistant", "content": r.text if r.text or not r.tool_calls else None}
    if r.reasoning:
        msg["reasoning_content"] = msg["reasoning"] = r.reasoning
    if r.tool_calls:
        msg["tool_calls"] = [c.openai() for c in r.tool_calls]
    return msg


def _finish(r: ChoiceResult) -> str | None:
    return r.finish_reason


def _data(obj: dict) -> dict:
    return {"data": json.dumps(obj, ensure_ascii=False)}


async def _chat_events(gen: Generation, rid: str) -> AsyncIterator[dict]:
    base = {"id": rid, "object": "chat.completion.chunk", "created": gen.created, "model": gen.model,
            "system_fingerprint": None}
    usage_null = {"usage": None} if gen.req.include_usage else {}
    started: set[int] = set()
    try:
        async for index, out in gen.outputs():
            delta: dict[str, Any] = {}
            if index not in started:
                started.add(index)
                delta["role"] = "assistant"
                delta["content"] = ""
            if out.text:
                delta["content"] = out.text
            if out.reasoning:
                delta["reasoning_content"] = delta["reasoning"] = out.reasoning
            if out.tool_calls:
                delta["tool_calls"] = [c.openai(k) for k, c in enumerate(out.tool_calls)]
            lps = chat_logprobs(gen, out.logprobs) if out.logprobs else None
            if not delta and lps is None and out.finish_reason is None:
                continue
            yield _data({**base, "choices": [{"index": index, "delta": delta, "logprobs": lps,
                                              "finish_reason": out.finish_reason}], **usage_null})
        if gen.req.include_usage:
            yield _data({**base, "choices": [], "usage": gen.usage.as_openai()})
        yield {"data": "[DONE]"}
    except Exception as e:  # after the response started: report in-band, then end the stream
        err = from_exception(e, gen.request_id)
        yield _data({"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}})
    finally:
        gen.close()


async def _completion_events(gen: Generation, rid: str) -> AsyncIterator[dict]:
    base = {"id": rid, "object": "text_completion", "created": gen.created, "model": gen.model,
            "system_fingerprint": None}
    usage_null = {"usage": None} if gen.req.include_usage else {}
    offsets: dict[int, int] = {}
    try:
        async for index, out in gen.outputs():
            lps = completion_logprobs(gen, out.logprobs, offsets.get(index, 0)) if out.logprobs else None
            offsets[index] = offsets.get(index, 0) + len(out.text)
            if not out.text and lps is None and out.finish_reason is None:
                continue
            yield _data({**base, "choices": [{"index": index, "text": out.text, "logprobs": lps,
                                              "finish_reason": out.finish_reason}], **usage_null})
        if gen.req.include_usage:
            yield _data({**base, "choices": [], "usage": gen.usage.as_openai()})
        yield {"data": "[DONE]"}
    except Exception as e:
        err = from_exception(e, gen.request_id)
        yield _data({"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}})
    finally:
        gen.close()


ROUTES = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
]
