"""OpenAI Responses adapter: POST /v1/responses (JSON or SSE with the response.* events), translated into a
GenerationRequest and back. Only `background: true` responses are stored (api/responses_background.py: poll,
resume the stream, cancel); conversations are not, so `previous_response_id` is refused with a 400.

Function tools, tool_choice, parallel_tool_calls, text.format and reasoning.effort map onto the chat route's
fields (tools, tool_choice, constraint, think; see chat_setup); function_call / function_call_output / reasoning
input items become the chat messages' tool_calls, tool messages and reasoning_content. The output is a
reasoning item (where the model thinks), a message item and a function_call item per call."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from edgeserve.server.api.responses_background import ROUTES as background_routes, start_background
from edgeserve.server.body import read_request
from edgeserve.server.errors import APIError, bad_request
from edgeserve.server.fields import model_name, number, positive, reject_unknown
from edgeserve.server.generation import ChoiceResult, Generation
from edgeserve.server.messages import assistant, content_text, tool_call, tool_result
from edgeserve.server.request import GenerationRequest
from edgeserve.server.respond import respond
from edgeserve.server.state import api_errors
from edgeserve.server.tools import function_tool, parse_tool_list, set_tools
from edgeserve.text.grammar import GrammarSpec
from edgeserve.text.tool_calls import ToolCall

_FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream",
           "previous_response_id", "text", "tools", "tool_choice", "parallel_tool_calls", "reasoning", "include",
           "truncation", "conversation", "prompt", "background", "top_logprobs", "stream_options"}
_IGNORED = {"store", "metadata", "user", "service_tier", "safety_identifier", "prompt_cache_key"}
_ROLES = {"user", "assistant", "system", "developer"}
_TEXT_PARTS = ("input_text", "output_text", "text")
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_INCLUDE = {"reasoning.encrypted_content"}


def _content(content: Any, where: str) -> str:
    return content_text(content, where, _TEXT_PARTS)


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
    thought: list[str | None] = [None]  # a reasoning item waiting for its assistant message
    for i, item in enumerate(value):
        here = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{here} must be an object", here)
        kind = item.get("type", "message")
        if kind not in _ITEMS:
            raise bad_request(f"{here}.type {kind!r} is not supported (message, function_call, function_call_output "
                              "and reasoning items are)", f"{here}.type")
        _ITEMS[kind](item, here, out, thought)
    return out


def _message_item(item: dict, here: str, out: list[dict], thought: list[str | None]) -> None:
    """A message item: its text parts; an assistant's takes the reasoning item before it."""
    role = item.get("role")
    if role not in _ROLES:
        raise bad_request(f"{here}.role must be one of user, assistant, system, developer; got {role!r}",
                          f"{here}.role")
    extra = set(item) - {"type", "role", "content", "id", "status", "phase"}
    if extra:
        raise bad_request(f"{here}.{sorted(extra)[0]} is not supported", f"{here}.{sorted(extra)[0]}")
    images: list = []
    text = content_text(item.get("content"), f"{here}.content", _TEXT_PARTS,
                        images=images if role == "user" else None)
    if role == "assistant":
        out.append(assistant(text, None, thought[0]))
        thought[0] = None
    else:
        msg = {"role": "system" if role == "developer" else role, "content": text}
        out.append({**msg, "images": images} if images else msg)


def _function_call_item(item: dict, here: str, out: list[dict], thought: list[str | None]) -> None:
    """A function_call item: a call on the assistant turn before it (or on a turn of its own)."""
    args = _item_string(item, "arguments", here) if item.get("arguments") != "" else "{}"
    call = tool_call(_item_string(item, "call_id", here), _item_string(item, "name", here), args, here)
    if not out or out[-1]["role"] != "assistant":  # calls without text: an assistant turn of their own
        out.append(assistant(""))
    if thought[0] is not None:
        out[-1]["reasoning_content"], thought[0] = thought[0], None
    out[-1].setdefault("tool_calls", []).append(call)


def _function_call_output_item(item: dict, here: str, out: list[dict], thought: list[str | None]) -> None:
    """A function_call_output item: a tool message."""
    out.append(tool_result(_item_string(item, "call_id", here), _content(item.get("output"), f"{here}.output")))


def _reasoning_item(item: dict, here: str, out: list[dict], thought: list[str | None]) -> None:
    """A reasoning item: kept for the next assistant turn's reasoning_content."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        raise bad_request(f"{here}.content must be a list of reasoning_text parts", f"{here}.content")
    thought[0] = "".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))


_ITEMS = {"message": _message_item, "function_call": _function_call_item,
          "function_call_output": _function_call_output_item, "reasoning": _reasoning_item}


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
    reject_unknown(body, _FIELDS, _IGNORED, "unsupported_parameter")
    model = model_name(body)
    _refuse_stateful(body)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions must be a string", "instructions")
    msgs = _input_messages(body.get("input"))
    if instructions:
        msgs = [{"role": "system", "content": instructions}, *msgs]
    req = GenerationRequest(model=model, messages=msgs)
    req.constraint = _text_format(body.get("text"))
    set_tools(req, parse_tool_list(body.get("tools"), _responses_tool), body)
    req.think = _reasoning(body.get("reasoning"))
    if req.think is not None:  # harmony's Reasoning: level (gpt-oss)
        req.template_kwargs["reasoning_effort"] = body["reasoning"]["effort"]
    req.max_tokens = positive(number(body, "max_output_tokens", integer=True), "max_output_tokens")
    for key in ("temperature", "top_p"):
        v = number(body, key)
        if v is not None:
            req.sampling[key] = v
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream must be true or false", "stream")
    if body.get("background") not in (None, True, False):
        raise bad_request("background must be true or false", "background")
    if body.get("background") and body.get("store") is False:
        raise bad_request("a background response is stored until it is read: store must not be false", "store")
    req.stream = stream
    if body.get("stream_options") is not None and not stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    return req


def _refuse_stateful(body: dict) -> None:
    """400 for what needs stored state or features this server does not have."""
    _refuse_unless(body, "previous_response_id", (None,),
                   "is not supported: this server stores no conversations (only background responses, to poll); "
                   "send the whole conversation as input items")
    _refuse_unless(body, "conversation", (None,), "is not supported: this server stores no conversations")
    _refuse_unless(body, "prompt", (None,), "(stored prompt templates) is not supported")
    include = body.get("include")
    if include is not None and (not isinstance(include, list)
                                or not all(isinstance(x, str) and x in _INCLUDE for x in include)):
        raise bad_request(f"include may only list {', '.join(sorted(_INCLUDE))} (accepted; nothing is encrypted)",
                          "include", "unsupported_parameter")
    _refuse_unless(body, "top_logprobs", (None, 0), "is not supported")
    _refuse_unless(body, "truncation", (None, "disabled"), "must be 'disabled' (a prompt past the context is a 400)")


class _Reply:
    """The output items and response object of one request, built up as the reply arrives."""

    def __init__(self, gen: Generation | None, body: dict, rid: str, created: int | None = None) -> None:
        self.gen, self.body, self.id = gen, body, rid  # gen None: not started (a queued background response)
        self.created = int(time.time()) if created is None else created
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

    def _sampling(self, key: str, default: float) -> float | None:
        """The value `key` ran with: the request's, else the model's recommended, else the server's default (None
        before the model is known)."""
        value = self.body.get(key)
        if value is not None or self.gen is None:
            return value
        return self.gen.lease.entry.sampling.get(key, default)

    def response(self, status: str, finish: str | None = None, n_out: int = 0, reasoning: str = "") -> dict:
        """The response object; when done, `self.items` is its output and usage is filled in."""
        done = status not in ("queued", "in_progress")
        usage = None
        if done and self.gen is not None:
            u = self.gen.usage
            thought = len(self.gen.lease.lm.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
            usage = {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
                     "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": min(thought, n_out)},
                     "total_tokens": u.prompt_tokens + n_out}
        text = self.body.get("text") or {}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
                "instructions": self.body.get("instructions"), "max_output_tokens": self.body.get("max_output_tokens"),
                "model": self.gen.model if self.gen is not None else self.body["model"],
                "output": self.items if done else [], "background": bool(self.body.get("background")),
                "parallel_tool_calls": self.body.get("parallel_tool_calls", True),
                "previous_response_id": None, "reasoning": {"effort": (self.body.get("reasoning") or {}).get("effort"),
                                                            "summary": None},
                "store": bool(self.body.get("background")), "temperature": self._sampling("temperature", 1.0),
                "text": {"format": text.get("format") or {"type": "text"}},
                "tool_choice": self.body.get("tool_choice", "auto"), "tools": self.body.get("tools") or [],
                "top_p": self._sampling("top_p", 1.0), "truncation": "disabled", "usage": usage,
                "metadata": self.body.get("metadata") or {}}


@api_errors
async def responses(request: Request) -> Response:
    """POST /v1/responses; `background: true` returns at once and runs on (api/responses_background.py)."""
    body, req = await read_request(request, lambda b: (b, parse_responses_request(b)))
    replier = ResponsesReplier(body, f"resp_{request.state.request_id}{secrets.token_hex(4)}")
    if body.get("background"):
        return start_background(request, req, replier)
    return await respond(request, req, replier)


def _part(kind: str, text: str) -> dict:
    """The content part of a reasoning or message item."""
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponsesReplier:
    """The response object, or its stream: response.created, response.in_progress, then per output item
    (reasoning, message, function_call) output_item.added, its parts and deltas (reasoning_text.*, content_part.*
    with output_text.*, function_call_arguments.*) and output_item.done; then response.completed (or .incomplete)."""

    prompt_param = "input"
    constraint_param = "text.format"
    ndjson = False
    ping = {"comment": "loading model"}

    def __init__(self, body: dict, rid: str) -> None:
        self.request_body, self.rid = body, rid
        self.created = int(time.time())
        self.seq = 0  # the next event's sequence_number
        self.open_kind: str | None = None  # "reasoning" / "message": the item taking deltas
        self.texts = {"reasoning": "", "message": ""}
        self.reply: _Reply | None = None
        self.latest: dict | None = None  # the response object the last response.* event carried
        self.failed: APIError | None = None  # the error that ended the stream
        self.n_out = 0  # output tokens so far
        self.announced = False  # response.created was sent already (a background response's, while queued)

    def snapshot(self, status: str) -> dict:
        """The response object now, with `status` (queued before the run starts; cancelled / failed after)."""
        reply = self.reply or _Reply(None, self.request_body, self.rid, self.created)
        out = reply.response(status, None, self.n_out, self.texts["reasoning"])
        if self.failed is not None:
            code = "server_error" if self.failed.status >= 500 else "invalid_prompt"
            out["error"] = {"code": code, "message": self.failed.message}
        return out

    def body(self, gen: Generation, results: list[ChoiceResult]) -> dict:
        """The response object."""
        r = results[0]
        reply = _Reply(gen, self.request_body, self.rid, self.created)
        reply.items = reply.items_of(r)
        status = "incomplete" if r.finish_reason == "length" else "completed"
        return reply.response(status, r.finish_reason, r.num_output_tokens, r.reasoning)

    def error(self, err: APIError) -> dict:
        """The error event that ends a stream."""
        self.failed = err
        return self.event("error", code=err.code, message=err.message, param=err.param)

    def event(self, kind: str, **data: Any) -> dict:
        """One SSE event, numbered."""
        if "response" in data:
            self.latest = data["response"]
        self.seq += 1
        return {"event": kind, "data": json.dumps({"type": kind, "sequence_number": self.seq - 1, **data},
                                                  ensure_ascii=False)}

    async def stream(self, gen: Generation) -> AsyncIterator[dict]:
        """The whole event sequence."""
        reply = self.reply = _Reply(gen, self.request_body, self.rid, self.created)
        if not self.announced:
            yield self.event("response.created", response=reply.response("in_progress"))
        yield self.event("response.in_progress", response=reply.response("in_progress"))
        last = None
        async for _, out in gen.outputs():
            for e in self.deltas(out):
                yield e
            last = out
        finish_reason = last.finish_reason if last else None
        status = "incomplete" if finish_reason == "length" else "completed"
        calls = (last.tool_calls if last else None) or []
        if not reply.items and not calls:  # an empty reply still has its (empty) message
            for e in self.start("message"):
                yield e
        for e in self.finish(status):
            yield e
        for call in calls:
            for e in self.call_events(call):
                yield e
        n_out = last.num_output_tokens if last else 0
        yield self.event(f"response.{status}", response=reply.response(status, finish_reason, n_out,
                                                                        self.texts["reasoning"]))

    def deltas(self, out: Any) -> list[dict]:
        """The reasoning and text deltas of one engine delta (opening their items as needed)."""
        events = []
        self.n_out = out.num_output_tokens
        for kind, piece in (("reasoning", out.reasoning), ("message", out.text)):
            if not piece:
                continue
            if self.open_kind != kind:
                events += self.start(kind)
            self.texts[kind] += piece
            delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            events.append(self.event(delta, **self.where(), delta=piece,
                                     **({} if kind == "reasoning" else {"logprobs": []})))
        return events

    def where(self) -> dict:
        """item_id, output_index and content_index of the open item."""
        assert self.reply is not None
        return {"item_id": self.reply.items[-1]["id"], "output_index": len(self.reply.items) - 1, "content_index": 0}

    def start(self, kind: str) -> list[dict]:
        """Finish the open item and add a `kind` item with its (empty) content part."""
        assert self.reply is not None
        out = self.finish("completed")
        self.open_kind = kind
        item_id = self.reply.new_id("rs" if kind == "reasoning" else "msg")
        self.reply.items.append(getattr(self.reply, kind)(item_id, None, "in_progress"))
        out.append(self.event("response.output_item.added", output_index=len(self.reply.items) - 1,
                              item=self.reply.items[-1]))
        out.append(self.event("response.content_part.added", **self.where(), part=_part(kind, "")))
        return out

    def finish(self, status: str) -> list[dict]:
        """The done events of the open item (none when no item is open)."""
        assert self.reply is not None
        if self.open_kind is None:
            return []
        kind, text = self.open_kind, self.texts[self.open_kind]
        self.open_kind = None
        done = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        out = [self.event(done, **self.where(), text=text, **extra),
               self.event("response.content_part.done", **self.where(), part=_part(kind, text))]
        self.reply.items[-1] = getattr(self.reply, kind)(self.reply.items[-1]["id"], text, status)
        out.append(self.event("response.output_item.done", output_index=len(self.reply.items) - 1,
                              item=self.reply.items[-1]))
        return out

    def call_events(self, call: ToolCall) -> list[dict]:
        """A function_call item: added, its arguments in one delta, done."""
        assert self.reply is not None
        item_id = self.reply.new_id("fc")
        self.reply.items.append(self.reply.function_call(item_id, call, "", "in_progress"))
        index = len(self.reply.items) - 1
        out = [self.event("response.output_item.added", output_index=index, item=self.reply.items[-1]),
               self.event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                          delta=call.arguments),
               self.event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                          arguments=call.arguments, name=call.name)]
        self.reply.items[-1] = self.reply.function_call(item_id, call, call.arguments, "completed")
        out.append(self.event("response.output_item.done", output_index=index, item=self.reply.items[-1]))
        return out


ROUTES = [Route("/v1/responses", responses, methods=["POST"]), *background_routes]
