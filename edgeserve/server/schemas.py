"""Request parsing and validation: every field a route accepts is type-checked here; a bad one is a 400 naming it.

Ranges of sampling values are checked once, by SamplingParams (its ValueError names the field).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from edgeserve.sampling_params import SamplingParams
from edgeserve.server.config import UNSET, parse_keep_alive
from edgeserve.server.errors import APIError, bad_request
from edgeserve.server.validate import check_range, expect_type, loads_bounded
from edgeserve.text.grammar import GrammarSpec


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 saying what is wrong with it."""
    data = loads_bounded(body)
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", "invalid_request_error", None, "invalid_json")
    return data


def _number(body: dict, key: str, *, integer: bool = False, where: str = "", range_key: str | None = None) -> Any:
    """body[key] as a number checked against its range (validate.RANGES[range_key or key]); None when absent."""
    value = body.get(key)
    if value is None:
        return None
    name = where + key
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}", name)
    if integer:
        if isinstance(value, float):
            if not value.is_integer():
                raise bad_request(f"{name} must be an integer, got {value!r}", name)
            value = int(value)
    elif not math.isfinite(value):
        raise bad_request(f"{name} must be a finite number, got {value!r}", name)
    check_range(value, name, range_key or key)
    return value


def _bool(body: dict, key: str, default: bool, where: str = "") -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{where}{key} must be true or false, got {value!r}", where + key)
    return value


def _stop(value: Any, name: str = "stop") -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise bad_request(f"{name} must be a non-empty string or a list of non-empty strings", name)
    return value


def _model(body: dict, default: str | None = None) -> str:
    value = body.get("model")
    if value is None and default is not None:
        return default
    if not isinstance(value, str) or not value:
        raise bad_request("model is required and must be a non-empty string", "model")
    return value


@dataclass
class GenerationRequest:
    """What the routes hand to the generation code: a prompt and everything about how to continue it."""

    model: str
    messages: list[dict[str, str]] | None = None  # chat: rendered with the model's template
    prompts: list[str | list[int]] = field(default_factory=list)  # completions / raw: text or token ids
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields except max_tokens
    max_tokens: int | None = None  # None: up to the context length
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False  # chat: report logprobs
    keep_alive: Any = UNSET  # seconds or None (forever); UNSET: the server default
    num_ctx: int | None = None  # this request's context window (Ollama options.num_ctx); None: the model's
    # structured output, tools and reasoning (parsed by edgeserve/server/tool_schemas.py; see Generation)
    constraint: GrammarSpec | None = None  # response_format / Ollama format: the answer must match it
    tools: list[dict] | None = None  # OpenAI-shaped function definitions
    tool_choice: str | dict = "none"  # "none" | "auto" | "required" | {"name": function}
    parallel_tool_calls: bool = True  # False: at most one call per reply
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # extra chat template variables
    think: bool | None = None  # reasoning on/off (Ollama think, enable_thinking); None: the template's default


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
    unknown = sorted(set(body) - allowed - _IGNORED)
    if unknown:
        raise bad_request(f"unsupported field {unknown[0]!r}", unknown[0], "unsupported_parameter")
    req = GenerationRequest(model=_model(body))
    for key, (target, integer) in _SAMPLING_NUMBERS.items():
        value = _number(body, key, integer=integer)
        if value is not None:
            req.sampling[target] = value
    req.sampling["stop"] = _stop(body.get("stop"))
    if body.get("ignore_eos") is not None:
        req.sampling["ignore_eos"] = _bool(body, "ignore_eos", False)
    n = _number(body, "n", integer=True)
    if n is not None and not 1 <= n <= max_n:
        raise bad_request(f"n must be between 1 and {max_n}, got {n}", "n")
    req.n = n or 1
    req.stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is not None:
        if not req.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
            raise bad_request("stream_options must be an object with only include_usage", "stream_options")
        req.include_usage = _bool(opts, "include_usage", False, "stream_options.")
    bias = body.get("logit_bias")
    if bias is not None:
        req.sampling["logit_bias"] = _logit_bias(bias)
    parse_openai_tools(body, req, chat="messages" in allowed)
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
                "parallel_tool_calls", "ignore_eos", "chat_template_kwargs", "reasoning_effort", *_SAMPLING_NUMBERS}


def parse_chat_request(body: dict, max_n: int) -> GenerationRequest:
    """Validate a POST /v1/chat/completions body."""
    req = _openai_common(body, _CHAT_FIELDS, max_n)
    req.messages = parse_messages(body.get("messages"))
    mt = _number(body, "max_completion_tokens", integer=True)
    name = "max_completion_tokens"
    if mt is None:
        mt, name = _number(body, "max_tokens", integer=True), "max_tokens"
    if mt is not None and mt < 1:
        raise bad_request(f"{name} must be a positive integer, got {mt}", name)
    req.max_tokens = mt
    req.logprobs = _bool(body, "logprobs", False)
    top = _number(body, "top_logprobs", integer=True)
    if top is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs: true", "top_logprobs")
    if top is not None and not 0 <= top <= SamplingParams.MAX_LOGPROBS:
        raise bad_request(f"top_logprobs must be between 0 and {SamplingParams.MAX_LOGPROBS}, got {top}",
                          "top_logprobs")
    if req.logprobs:
        req.sampling["logprobs"] = 0 if top is None else top
    return req


_COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "n", "stream", "stream_options", "stop", "logprobs",
                      "echo", "suffix", "best_of", "logit_bias", "ignore_eos", "response_format", *_SAMPLING_NUMBERS}


def parse_completion_request(body: dict, max_n: int) -> GenerationRequest:
    """Validate a POST /v1/completions body (prompt: a string, strings, token ids, or lists of token ids)."""
    req = _openai_common(body, _COMPLETION_FIELDS, max_n)
    req.prompts = parse_prompt(body.get("prompt"))
    if len(req.prompts) * req.n > max_n:  # one request may not take the whole waiting queue
        raise bad_request(f"a request may ask for at most {max_n} completions (prompts x n), got "
                          f"{len(req.prompts)} prompt(s) x n={req.n}", "prompt")
    mt = _number(body, "max_tokens", integer=True)
    if mt is not None and mt < 1:
        raise bad_request(f"max_tokens must be a positive integer, got {mt}", "max_tokens")
    req.max_tokens = 16 if mt is None else mt  # OpenAI's default for completions
    lp = _number(body, "logprobs", integer=True)
    if lp is not None and not 0 <= lp <= SamplingParams.MAX_LOGPROBS:
        raise bad_request(f"logprobs must be between 0 and {SamplingParams.MAX_LOGPROBS}, got {lp}", "logprobs")
    if lp is not None:
        req.sampling["logprobs"] = lp
    if _bool(body, "echo", False):
        raise bad_request("echo is not supported", "echo", "unsupported_parameter")
    if expect_type(body, "suffix", str, "a string"):
        raise bad_request("suffix (insertion) is not supported", "suffix", "unsupported_parameter")
    best_of = _number(body, "best_of", integer=True)
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


_ROLES = {"system", "user", "assistant", "developer", "tool"}


def parse_messages(value: Any, where: str = "messages") -> list[dict[str, str]]:
    """Chat messages as [{"role", "content"}], content flattened from text parts; anything else is a 400."""
    if not isinstance(value, list) or not value:
        raise bad_request(f"{where} is required and must be a non-empty list of messages", where)
    out = []
    for i, m in enumerate(value):
        here = f"{where}[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{here} must be an object with role and content", here)
        extra = set(m) - {"role", "content", "name", "images", "tool_calls", "tool_call_id", "tool_name",
                          "thinking", "reasoning_content"}
        if extra:
            raise bad_request(f"{here}.{sorted(extra)[0]} is not supported", f"{here}.{sorted(extra)[0]}")
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise bad_request(f"{here}.role must be one of system, user, assistant, developer, tool; got {role!r}",
                              f"{here}.role")
        if expect_type(m, "images", list, "a list", here + "."):
            raise bad_request(f"{here}.images: images are not supported", f"{here}.images")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"{here}.content[{j}] must be a text part "
                                      "({\"type\": \"text\", \"text\": ...}); other content types are not supported",
                                      f"{here}.content[{j}]")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None and role in ("assistant", "tool"):
            content = ""
        if not isinstance(content, str):
            raise bad_request(f"{here}.content must be a string or a list of text parts", f"{here}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content,
                    **parse_message_tool_fields(m, here)})
    return out


# --- Ollama -----------------------------------------------------------------------------------------------------

_OLLAMA_OPTIONS = {  # option -> (SamplingParams field, integer?)
    "temperature": ("temperature", False),
    "top_p": ("top_p", False),
    "top_k": ("top_k", True),
    "min_p": ("min_p", False),
    "seed": ("seed", True),
    "repeat_penalty": ("repetition_penalty", False),
    "presence_penalty": ("presence_penalty", False),
    "frequency_penalty": ("frequency_penalty", False),
}


def _ollama_options(body: dict, req: GenerationRequest) -> None:
    opts = body.get("options")
    if opts is None:
        return
    if not isinstance(opts, dict):
        raise bad_request("options must be an object", "options")
    for key, value in opts.items():
        if key in _OLLAMA_OPTIONS:
            target, integer = _OLLAMA_OPTIONS[key]
            v = _number(opts, key, integer=integer, where="options.", range_key=target)
            if v is not None:
                req.sampling[target] = v
        elif key == "num_predict":
            v = _number(opts, key, integer=True, where="options.")
            if v is not None and v > 0:  # Ollama: -1 (or unset) is unlimited
                req.max_tokens = v
            elif v is not None and v not in (-1, -2):
                raise bad_request(f"options.num_predict must be positive or -1, got {v}", "options.num_predict")
        elif key == "stop":
            req.sampling["stop"] = _stop(value, "options.stop")
        elif key == "num_ctx":
            req.num_ctx = _num_ctx(opts)
        else:
            raise bad_request(f"options.{key} is not supported; supported options: "
                              f"{', '.join(sorted([*_OLLAMA_OPTIONS, 'num_predict', 'stop', 'num_ctx']))}", f"options.{key}")


def _num_ctx(opts: dict) -> int | None:
    """options.num_ctx: a positive context window in tokens (the model's own limit still applies)."""
    v = _number(opts, "num_ctx", integer=True, where="options.")
    if v is not None and v < 1:
        raise bad_request(f"options.num_ctx must be a positive integer, got {v}", "options.num_ctx")
    return v


def _ollama_common(body: dict, allowed: set[str]) -> GenerationRequest:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad_request(f"unsupported field {unknown[0]!r}", unknown[0])
    req = GenerationRequest(model=_model(body))
    req.stream = _bool(body, "stream", True)
    if body.get("keep_alive") is not None:
        try:
            req.keep_alive = parse_keep_alive(body["keep_alive"])
        except ValueError as e:
            raise bad_request(str(e), "keep_alive")
    parse_ollama_tools(body, req, chat="messages" in allowed)
    _ollama_options(body, req)
    return req


def parse_ollama_chat(body: dict) -> GenerationRequest:
    """Validate a POST /api/chat body; an empty `messages` only loads or unloads the model."""
    req = _ollama_common(body, {"model", "messages", "stream", "options", "keep_alive", "format", "tools",
                                "think"})
    msgs = body.get("messages")
    req.messages = [] if msgs is None or msgs == [] else parse_messages(msgs)
    return req


def parse_ollama_generate(body: dict) -> GenerationRequest:
    """Validate a POST /api/generate body; an empty prompt only loads or unloads the model."""
    req = _ollama_common(body, {"model", "prompt", "system", "raw", "stream", "options", "keep_alive", "format",
                                "images", "suffix", "context", "template", "think"})
    for key, types, what in (("images", list, "a list"), ("suffix", str, "a string"), ("context", list, "a list"),
                             ("template", str, "a string")):
        if expect_type(body, key, types, what):
            raise bad_request(f"{key} is not supported", key)
    prompt = body.get("prompt", "")
    if prompt is None:
        prompt = ""
    if not isinstance(prompt, str):
        raise bad_request("prompt must be a string", "prompt")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise bad_request("system must be a string", "system")
    if not prompt:
        req.messages = []
    elif _bool(body, "raw", False):
        req.prompts = [prompt]
    else:
        req.messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}]
    return req


from edgeserve.server.tool_schemas import (parse_message_tool_fields, parse_ollama_tools,  # noqa: E402
                                           parse_openai_tools)
