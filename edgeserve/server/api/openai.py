"""OpenAI adapter: GET /v1/models, POST /v1/chat/completions and /v1/completions (JSON or SSE chunks).

The body is parsed into a GenerationRequest (every field checked here, with OpenAI's error shape); the pipeline
(edgeserve/server/respond.py) runs it, and the repliers below shape its events as chat.completion(.chunk) and
text_completion objects.
"""

from __future__ import annotations

import json
from secrets import token_hex
from typing import Any, AsyncIterator

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edgeserve.engine.outputs import TokenLogprob
from edgeserve.sampling_params import SamplingParams
from edgeserve.server.adapters import adapter_base
from edgeserve.server.body import read_request
from edgeserve.server.detached_runs import reattach, resumed_post, start_resumable
from edgeserve.server.errors import APIError, bad_request
from edgeserve.server.fields import boolean, expect_type, model_name, number, reject_unknown, stop_list
from edgeserve.server.generation import ChoiceResult, Generation
from edgeserve.server.messages import parse_messages, set_continuation
from edgeserve.server.model_details import spec_facts
from edgeserve.server.request import GenerationRequest
from edgeserve.server.respond import respond
from edgeserve.server.state import api_errors, server_state
from edgeserve.server.tools import parse_tools, set_tools
from edgeserve.text.grammar import GrammarSpec

MAX_BUDGET = 2**31 - 1  # the largest thinking budget a request may give
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's reasoning_effort values
# llama-server's reasoning_format values: "none" keeps the reasoning in the content; the others split it off
REASONING_FORMATS = ("none", "auto", "deepseek")

# --- the request ------------------------------------------------------------------------------------------------

_SAMPLING_NUMBERS = {  # request field -> (SamplingParams field, integer?)
    "temperature": ("temperature", False),
    "top_p": ("top_p", False),
    "top_k": ("top_k", True),
    "min_p": ("min_p", False),
    "presence_penalty": ("presence_penalty", False),
    "frequency_penalty": ("frequency_penalty", False),
    "repetition_penalty": ("repetition_penalty", False),
    "seed": ("seed", True),
}

# Fields that change nothing about the reply and are accepted as such (OpenAI bookkeeping).
_IGNORED = {"user", "metadata", "store", "service_tier"}


def _openai_common(body: dict, allowed: set[str], max_n: int) -> GenerationRequest:
    """The fields chat and completions share: model, sampling, stop, n, stream, logit_bias, format and tools."""
    reject_unknown(body, allowed, _IGNORED, "unsupported_parameter")
    req = GenerationRequest(model=model_name(body))
    for key, (target, integer) in _SAMPLING_NUMBERS.items():
        value = number(body, key, integer=integer)
        if value is not None:
            req.sampling[target] = value
    req.sampling["stop"] = stop_list(body.get("stop"))
    if body.get("ignore_eos") is not None:
        req.sampling["ignore_eos"] = boolean(body, "ignore_eos", False)
    n = number(body, "n", integer=True)
    if n is not None and not 1 <= n <= max_n:
        raise bad_request(f"n must be between 1 and {max_n}, got {n}", "n")
    req.n = n or 1
    req.stream = boolean(body, "stream", False)
    opts = body.get("stream_options")
    if opts is not None:
        if not req.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "resumable"}:
            raise bad_request("stream_options must be an object with include_usage and/or resumable",
                              "stream_options")
        req.include_usage = boolean(opts, "include_usage", False, "stream_options.")
        req.resumable = boolean(opts, "resumable", False, "stream_options.")
    bias = body.get("logit_bias")
    if bias is not None:
        req.sampling["logit_bias"] = _logit_bias(bias)
    parse_openai_tools(body, req, chat="messages" in allowed)
    if body.get("lora") is not None:  # llama-server's per-request adapters (edgeserve/server/adapters.py)
        if not isinstance(body["lora"], list):
            raise bad_request('lora must be a list of {"id", "scale"} objects', "lora")
        req.lora = body["lora"]
    return req


def _logit_bias(value) -> dict[int, float]:
    """OpenAI's logit_bias ({"token id": bias}) as {int: float}; SamplingParams checks the ranges."""
    if not isinstance(value, dict):
        raise bad_request("logit_bias must be an object mapping token ids to numbers", "logit_bias")
    out = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise bad_request(f"logit_bias values must be numbers, got {bias!r}", "logit_bias")
        out[token] = float(bias)
    return out


_CHAT_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options",
                "stop", "logprobs", "top_logprobs", "response_format", "logit_bias", "tools", "tool_choice",
                "parallel_tool_calls", "ignore_eos", "chat_template_kwargs", "reasoning_effort", "reasoning_format",
                "lora", "continue_final_message", "add_generation_prompt", "thinking_budget_tokens",
                "max_thinking_tokens", *_SAMPLING_NUMBERS}


def parse_chat_request(body: dict, max_n: int) -> GenerationRequest:
    """Validate a POST /v1/chat/completions body."""
    req = _openai_common(body, _CHAT_FIELDS, max_n)
    req.messages = parse_messages(body.get("messages"), tool_call_ids=True)
    set_continuation(req, req.messages, body.get("continue_final_message"), body.get("add_generation_prompt"))
    mt = number(body, "max_completion_tokens", integer=True)
    name = "max_completion_tokens"
    if mt is None:
        mt, name = number(body, "max_tokens", integer=True), "max_tokens"
    if mt is not None and mt < 1:
        raise bad_request(f"{name} must be a positive integer, got {mt}", name)
    req.max_tokens = mt
    req.logprobs = boolean(body, "logprobs", False)
    top = number(body, "top_logprobs", integer=True)
    if top is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs: true", "top_logprobs")
    if top is not None and not 0 <= top <= SamplingParams.MAX_LOGPROBS:
        raise bad_request(f"top_logprobs must be between 0 and {SamplingParams.MAX_LOGPROBS}, got {top}",
                          "top_logprobs")
    if req.logprobs:
        req.sampling["logprobs"] = 0 if top is None else top
    req.reasoning_format = body.get("reasoning_format")
    if req.reasoning_format is not None and req.reasoning_format not in REASONING_FORMATS:
        raise bad_request(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}", "reasoning_format")
    req.thinking_budget = _thinking_budget(body)
    return req


def _thinking_budget(body: dict) -> int | None:
    """`thinking_budget_tokens` or its alias `max_thinking_tokens`: reasoning tokens before the thought is closed."""
    given = {name: number(body, name, integer=True) for name in ("thinking_budget_tokens", "max_thinking_tokens")}
    values = {name: v for name, v in given.items() if v is not None}
    for name, v in values.items():
        if not 0 <= v <= MAX_BUDGET:
            raise bad_request(f"{name} must be an integer from 0 to {MAX_BUDGET}, got {v}", name)
    if len(set(values.values())) > 1:
        raise bad_request("thinking_budget_tokens and max_thinking_tokens differ; give one", "max_thinking_tokens")
    return next(iter(values.values()), None)


_COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "n", "stream", "stream_options", "stop", "logprobs",
                      "echo", "suffix", "best_of", "logit_bias", "ignore_eos", "response_format", "lora",
                      *_SAMPLING_NUMBERS}


def parse_completion_request(body: dict, max_n: int) -> GenerationRequest:
    """Validate a POST /v1/completions body (prompt: a string, strings, token ids, or lists of token ids)."""
    req = _openai_common(body, _COMPLETION_FIELDS, max_n)
    req.prompts = parse_prompt(body.get("prompt"))
    if len(req.prompts) * req.n > max_n:  # one request may not take the whole waiting queue
        raise bad_request(f"a request may ask for at most {max_n} completions (prompts x n), got "
                          f"{len(req.prompts)} prompt(s) x n={req.n}", "prompt")
    mt = number(body, "max_tokens", integer=True)
    if mt is not None and mt < 1:
        raise bad_request(f"max_tokens must be a positive integer, got {mt}", "max_tokens")
    req.max_tokens = 16 if mt is None else mt  # OpenAI's default for completions
    lp = number(body, "logprobs", integer=True)
    if lp is not None and not 0 <= lp <= SamplingParams.MAX_LOGPROBS:
        raise bad_request(f"logprobs must be between 0 and {SamplingParams.MAX_LOGPROBS}, got {lp}", "logprobs")
    if lp is not None:
        req.sampling["logprobs"] = lp
    if boolean(body, "echo", False):
        raise bad_request("echo is not supported", "echo", "unsupported_parameter")
    if expect_type(body, "suffix", str, "a string"):
        raise bad_request("suffix (insertion) is not supported", "suffix", "unsupported_parameter")
    best_of = number(body, "best_of", integer=True)
    if best_of is not None and best_of != req.n:
        raise bad_request("best_of is not supported (only best_of equal to n)", "best_of", "unsupported_parameter")
    return req


def parse_prompt(value: Any) -> list[str | list[int]]:
    """A completions prompt as a list of prompts, each text or token ids."""
    def ids_ok(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                       for i in x)

    if isinstance(value, str):
        return [value]
    if ids_ok(value):
        return [value]
    if isinstance(value, list) and value and all(isinstance(p, str) or ids_ok(p) for p in value):
        return list(value)
    raise bad_request("prompt is required: a string, a list of strings, a list of token ids or a list of those",
                      "prompt")


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


def _template_kwargs(value: Any) -> dict[str, Any]:
    """`chat_template_kwargs`: template variables, none of those the server sets itself."""
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
    set_tools(req, parse_tools(body.get("tools")), body)
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


# --- the reply -------------------------------------------------------------------------------------------------


async def list_models(request: Request) -> Response:
    """GET /v1/models: the configured models and pulled catalog models, each with its `capabilities` (as /api/show
    says them: "completion", or "embedding" / "rerank") where its file can be read."""
    st = server_state(request)

    def listing() -> list[dict[str, Any]]:
        data = []
        for mid, spec in st.manager.known().items():
            facts = spec_facts(spec)
            data.append({"id": mid, "object": "model", "created": st.started, "owned_by": "edgeserve",
                         **({"capabilities": facts.capabilities} if facts else {})})
        data += [{"id": name, "object": "model", "created": st.started, "owned_by": "edgeserve",
                  "parent": adapter_base(st.manager, name), "root": path}
                 for name, path in st.manager.adapters.items()]
        return data

    # headers are read from the files (once per file version): off the event loop
    return JSONResponse({"object": "list", "data": await anyio.to_thread.run_sync(listing)})


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
    """POST /v1/chat/completions (a `Last-Event-ID: ID/N` header: the rest of resumable stream ID)."""
    return await _generate(request, parse_chat_request, ChatReplier, "chatcmpl")


@api_errors
async def completions(request: Request) -> Response:
    """POST /v1/completions (a `Last-Event-ID: ID/N` header: the rest of resumable stream ID)."""
    return await _generate(request, parse_completion_request, CompletionReplier, "cmpl")


async def _generate(request: Request, parse, replier, prefix: str) -> Response:
    """A resumed stream, a resumable one started, or the reply of a request read by `parse`, written by `replier`
    under the id `prefix`-<request id>."""
    resumed = resumed_post(request)
    if resumed is not None:
        return resumed
    max_n = server_state(request).config.max_n
    req = await read_request(request, lambda body: parse(body, max_n))
    if req.resumable:
        return start_resumable(request, req, replier(f"{prefix}-{request.state.request_id}{token_hex(4)}"))
    return await respond(request, req, replier(f"{prefix}-{request.state.request_id}"))


def openai_error_event(err: APIError) -> dict:
    """An error after an SSE stream started, in OpenAI's shape."""
    return _data({"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}})


def chat_message(r: ChoiceResult) -> dict[str, Any]:
    """The assistant message of a choice: content, reasoning (`reasoning_content`, also as `reasoning`) and
    `tool_calls` (content is null when the reply is only calls)."""
    msg: dict[str, Any] = {"role": "assistant", "content": r.text if r.text or not r.tool_calls else None}
    if r.reasoning:
        msg["reasoning_content"] = msg["reasoning"] = r.reasoning
    if r.tool_calls:
        msg["tool_calls"] = [c.openai() for c in r.tool_calls]
    return msg


def _data(obj: dict) -> dict:
    return {"data": json.dumps(obj, ensure_ascii=False)}


class _Replier:
    """What both OpenAI routes share: SSE, the loading comment, the error shape, usage and the closing [DONE]."""

    ndjson = False
    ping = {"comment": "loading model"}
    constraint_param = "response_format"
    object = chunk_object = ""  # the reply's and the chunks' `object`

    def __init__(self, rid: str) -> None:
        self.rid = rid

    def error(self, err: APIError) -> dict:
        """An error after the stream started, in OpenAI's shape."""
        return openai_error_event(err)

    def envelope(self, gen: Generation, kind: str) -> dict[str, Any]:
        """id, object, created, model and system_fingerprint of a reply or a chunk."""
        return {"id": self.rid, "object": kind, "created": gen.created, "model": gen.model, "system_fingerprint": None}

    def reply(self, gen: Generation, choices: list[dict]) -> dict:
        """The whole (non-streamed) reply with these choices."""
        return {**self.envelope(gen, self.object), "choices": choices, "usage": gen.usage.as_openai()}

    async def stream(self, gen: Generation) -> AsyncIterator[dict]:
        """A chunk per delta that says something, the usage chunk when asked for, then [DONE]."""
        base = self.envelope(gen, self.chunk_object)
        usage_null = {"usage": None} if gen.req.include_usage else {}
        async for index, out in gen.outputs():
            choice = self.chunk_choice(gen, index, out)
            if choice is not None:
                yield _data({**base, "choices": [choice], **usage_null})
        if gen.req.include_usage:
            yield _data({**base, "choices": [], "usage": gen.usage.as_openai()})
        yield {"data": "[DONE]"}


class ChatReplier(_Replier):
    """chat.completion replies and chat.completion.chunk streams."""

    prompt_param = "messages"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, rid: str) -> None:
        super().__init__(rid)
        self.started: set[int] = set()

    def body(self, gen: Generation, results: list[ChoiceResult]) -> dict:
        """The chat.completion object."""
        return self.reply(gen, [{"index": r.index, "message": chat_message(r),
                                 "logprobs": chat_logprobs(gen, r.logprobs), "finish_reason": r.finish_reason}
                                for r in results])

    def chunk_choice(self, gen: Generation, index: int, out: Any) -> dict | None:
        """One chunk's choice (None when the delta says nothing): the first carries the role."""
        delta: dict[str, Any] = {}
        if index not in self.started:
            self.started.add(index)
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
            return None
        return {"index": index, "delta": delta, "logprobs": lps, "finish_reason": out.finish_reason}


class CompletionReplier(_Replier):
    """text_completion replies and streams."""

    prompt_param = "prompt"
    object = chunk_object = "text_completion"

    def __init__(self, rid: str) -> None:
        super().__init__(rid)
        self.offsets: dict[int, int] = {}

    def body(self, gen: Generation, results: list[ChoiceResult]) -> dict:
        """The text_completion object."""
        return self.reply(gen, [{"index": r.index, "text": r.text, "logprobs": completion_logprobs(gen, r.logprobs),
                                 "finish_reason": r.finish_reason} for r in results])

    def chunk_choice(self, gen: Generation, index: int, out: Any) -> dict | None:
        """One chunk's choice (None when the delta says nothing); logprobs' text offsets run on across chunks."""
        offset = self.offsets.get(index, 0)
        lps = completion_logprobs(gen, out.logprobs, offset) if out.logprobs else None
        self.offsets[index] = offset + len(out.text)
        if not out.text and lps is None and out.finish_reason is None:
            return None
        return {"index": index, "text": out.text, "logprobs": lps, "finish_reason": out.finish_reason}


ROUTES = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions/{stream_id}", api_errors(reattach), methods=["GET"]),
    Route("/v1/completions/{stream_id}", api_errors(reattach), methods=["GET"]),
]
