"""Ollama adapter: POST /api/chat and /api/generate (NDJSON stream by default, or one JSON reply).

The body is parsed into a GenerationRequest (every field checked here; errors in Ollama's {"error"} shape); the
pipeline (edgeserve/server/respond.py) runs it, and `OllamaReplier` shapes its events as Ollama's lines, the last
one with Ollama's timings. An empty `messages` / `prompt` only loads or unloads the model.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import time
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edgeserve.engine.outputs import TokenLogprob
from edgeserve.server.body import read_request
from edgeserve.server.errors import APIError, bad_request
from edgeserve.server.fields import boolean, expect_type, keep_alive, model_name, number, reject_unknown, stop_list
from edgeserve.server.generation import ChoiceResult, Generation
from edgeserve.server.image_parts import base64_images
from edgeserve.server.messages import parse_messages, set_continuation
from edgeserve.server.request import GenerationRequest
from edgeserve.server.respond import respond
from edgeserve.server.state import api_errors, server_state
from edgeserve.server.tools import parse_tools
from edgeserve.text.grammar import GrammarSpec

log = logging.getLogger("edgeserve.server")

# --- the request ------------------------------------------------------------------------------------------------

_OLLAMA_OPTIONS = {  # option -> (SamplingParams field, integer?)
    "temperature": ("temperature", False),
    "top_p": ("top_p", False),
    "top_k": ("top_k", True),
    "min_p": ("min_p", False),
    "seed": ("seed", True),
    "repeat_penalty": ("repetition_penalty", False),
    "presence_penalty": ("presence_penalty", False),
    "frequency_penalty": ("frequency_penalty", False),
    "repeat_last_n": ("penalty_last_n", True),
    "typical_p": ("typical_p", False),
}
# Options Ollama documents that change nothing here (the hardware and loading ones: this server decides those
# itself; tfs_z and mirostat: samplers it does not have). Checked for type and range, logged once, then ignored.
_IGNORED_NUMBERS = {"num_thread": True, "num_gpu": True, "main_gpu": True, "num_batch": True, "num_keep": True,
                    "mirostat": True, "tfs_z": False, "mirostat_eta": False, "mirostat_tau": False}
_IGNORED_FLAGS = {"use_mmap", "use_mlock", "numa", "low_vram", "vocab_only", "f16_kv", "logits_all",
                  "embedding_only", "penalize_newline"}
_logged_ignored: set[str] = set()


def _ollama_options(body: dict, req: GenerationRequest) -> None:
    """`options`: sampling values, num_predict, stop and num_ctx; Ollama's other documented options are checked
    and ignored (logged once each); an unknown option is a 400 naming it."""
    opts = body.get("options")
    if opts is None:
        return
    if not isinstance(opts, dict):
        raise bad_request("options must be an object", "options")
    for key, value in opts.items():
        if key in _OLLAMA_OPTIONS:
            target, integer = _OLLAMA_OPTIONS[key]
            v = number(opts, key, integer=integer, where="options.", range_key=target)
            if v is not None:
                req.sampling[target] = v
        elif key == "num_predict":
            v = number(opts, key, integer=True, where="options.")
            if v is not None and v > 0:  # Ollama: -1 (or unset) is unlimited
                req.max_tokens = v
            elif v is not None and v not in (-1, -2):
                raise bad_request(f"options.num_predict must be positive or -1, got {v}", "options.num_predict")
        elif key == "stop":
            req.sampling["stop"] = stop_list(value, "options.stop")
        elif key == "num_ctx":
            req.num_ctx = _num_ctx(opts)
        elif key in _IGNORED_NUMBERS or key in _IGNORED_FLAGS:
            _ignored_option(opts, key)
        else:
            known = ", ".join(sorted([*_OLLAMA_OPTIONS, "num_predict", "stop", "num_ctx",
                                      *_IGNORED_NUMBERS, *_IGNORED_FLAGS]))
            raise bad_request(f"options.{key} is not a known option; known options: {known}", f"options.{key}")


def _ignored_option(opts: dict, key: str) -> None:
    """Check an option this server accepts without using it, and log the first time each one is seen."""
    if key in _IGNORED_FLAGS:
        boolean(opts, key, False, where="options.")
    else:
        number(opts, key, integer=_IGNORED_NUMBERS[key], where="options.")
    if opts.get(key) is not None and key not in _logged_ignored:
        _logged_ignored.add(key)
        log.info("Ollama option %s accepted and ignored (this server sets it itself or has no such sampler)", key)


def _num_ctx(opts: dict) -> int | None:
    """options.num_ctx: a positive context window in tokens (the model's own limit still applies)."""
    v = number(opts, "num_ctx", integer=True, where="options.")
    if v is not None and v < 1:
        raise bad_request(f"options.num_ctx must be a positive integer, got {v}", "options.num_ctx")
    return v


def _ollama_common(body: dict, allowed: set[str]) -> GenerationRequest:
    """The fields /api/chat and /api/generate share: model, stream, keep_alive, format, think, logprobs, options."""
    reject_unknown(body, allowed)
    req = GenerationRequest(model=model_name(body))
    req.stream = boolean(body, "stream", True)
    req.keep_alive = keep_alive(body)
    req.constraint = parse_ollama_format(body.get("format"))
    _think(body, req)
    _logprobs(body, req)
    _ollama_options(body, req)
    return req


def parse_ollama_chat(body: dict) -> GenerationRequest:
    """Validate a POST /api/chat body; an empty `messages` only loads or unloads the model."""
    req = _ollama_common(body, {"model", "messages", "stream", "options", "keep_alive", "format", "tools",
                                "think", "logprobs", "top_logprobs"})
    msgs = body.get("messages")
    req.messages = [] if msgs is None or msgs == [] else parse_messages(msgs)
    set_continuation(req, req.messages)  # a final assistant message is continued, as Ollama does
    req.tools = parse_tools(body.get("tools"))
    req.tool_choice = "auto" if req.tools else "none"
    return req


def parse_ollama_generate(body: dict) -> GenerationRequest:
    """Validate a POST /api/generate body; an empty prompt only loads or unloads the model."""
    req = _ollama_common(body, {"model", "prompt", "system", "raw", "stream", "options", "keep_alive", "format",
                                "images", "suffix", "context", "template", "think", "logprobs", "top_logprobs"})
    for key, types, what in (("suffix", str, "a string"), ("context", list, "a list"), ("template", str, "a string")):
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
    images = base64_images(body["images"], "images") if body.get("images") is not None else []
    if not prompt and not images:
        req.messages = []
    elif boolean(body, "raw", False):
        if images:
            raise bad_request("images need the chat template: raw must be false", "images")
        req.prompts = [prompt]
    else:
        user = {"role": "user", "content": "".join(i.mark for i in images) + prompt}
        req.messages = ([{"role": "system", "content": system}] if system else []) + [
            {**user, "images": images} if images else user]
    return req


def parse_ollama_format(value: Any) -> GrammarSpec | None:
    """Ollama `format`: "json" (any JSON object) or a JSON schema."""
    if value in (None, ""):
        return None
    if value == "json":
        return GrammarSpec("json_object")
    if isinstance(value, dict):
        return GrammarSpec.json_schema(value)
    raise bad_request(f"format must be \"json\" or a JSON schema object, got {value!r}", "format")


def _logprobs(body: dict, req: GenerationRequest) -> None:
    """`logprobs` (true: each generated token's log probability) and `top_logprobs` (that many alternatives)."""
    req.logprobs = boolean(body, "logprobs", False)
    top = number(body, "top_logprobs", integer=True)
    if top and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    if req.logprobs:
        req.sampling["logprobs"] = top or 0


def _think(body: dict, req: GenerationRequest) -> None:
    """`think`: true / false, or a level (low, medium, high: harmony's Reasoning: level, as gpt-oss reads it)."""
    think = body.get("think")
    if think is None:
        return
    if think in ("low", "medium", "high"):
        req.template_kwargs["reasoning_effort"] = think
        think = True
    if not isinstance(think, bool):
        raise bad_request(f"think must be true or false, got {think!r}", "think")
    req.think = req.think_required = think  # Ollama: thinking asked of a model that cannot think is a 400


# --- the reply --------------------------------------------------------------------------------------------------


def now_iso(t: float | None = None) -> str:
    """A wall-clock time as Ollama writes it (ISO 8601, UTC)."""
    try:
        return dt.datetime.fromtimestamp(time.time() if t is None else t, dt.timezone.utc).isoformat()
    except (OverflowError, OSError, ValueError):  # beyond datetime's years: as good as never
        return "9999-12-31T23:59:59+00:00"


async def _load_or_unload(request: Request, req: GenerationRequest, kind: str) -> Response:
    """An empty chat / prompt: load the model (or unload it with keep_alive 0) and say which was done."""
    st = server_state(request)
    if req.keep_alive == 0:
        await st.manager.unload_by_name(req.model)
        reason = "unload"
    else:
        lease = await st.manager.acquire(req.model, req.keep_alive)
        lease.release()
        reason = "load"
    mid, _ = st.manager.canonical(req.model)
    body: dict[str, Any] = {"model": mid, "created_at": now_iso(), "done": True, "done_reason": reason}
    if kind == "chat":
        body["message"] = {"role": "assistant", "content": ""}
    else:
        body["response"] = ""
    return JSONResponse(body)


def ollama_message(content: str, thinking: str = "", calls: list | None = None) -> dict[str, Any]:
    """An Ollama assistant message: content, `thinking` and `tool_calls` (arguments as objects) when present."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking:
        msg["thinking"] = thinking
    if calls:
        msg["tool_calls"] = [c.ollama() for c in calls]
    return msg


def _token(gen: Generation, token_id: int, logprob: float) -> dict[str, Any]:
    text = gen.token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def ollama_logprobs(gen: Generation, lps: list[TokenLogprob] | None) -> dict[str, Any]:
    """{"logprobs": [{token, logprob, bytes, top_logprobs?}]} for some tokens when the request asked; else {}."""
    if not gen.req.logprobs or not lps:
        return {}
    top = gen.req.sampling.get("logprobs") or 0
    return {"logprobs": [{**_token(gen, lp.token_id, lp.logprob),
                          **({"top_logprobs": [_token(gen, t, v) for t, v in lp.top]} if top else {})}
                         for lp in lps]}


class OllamaReplier:
    """Ollama's reply to /api/chat (`message`) or /api/generate (`response`): NDJSON lines while streaming, the
    last one (done: true) with done_reason and Ollama's counts and durations (nanoseconds)."""

    ndjson = True
    ping = None
    constraint_param = "format"

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.prompt_param = "messages" if kind == "chat" else "prompt"

    def piece(self, text: str, thinking: str = "", calls: list | None = None) -> dict[str, Any]:
        """The generated part of a line: a message (chat) or response text (generate)."""
        if self.kind == "chat":
            return {"message": ollama_message(text, thinking, calls)}
        return {"response": text, **({"thinking": thinking} if thinking else {})}

    def final(self, gen: Generation, finish: str | None, n_prompt: int, n_out: int) -> dict[str, Any]:
        """The last line's fields: done, done_reason, and the counts and durations."""
        end = time.monotonic()
        first = gen.first_token_at or end  # prefill ends when the first token is out
        return {"model": gen.model, "created_at": now_iso(), **self.piece(""), "done": True,
                "done_reason": "stop" if finish in (None, "tool_calls") else finish,  # Ollama: calls end with stop
                "total_duration": int((end - gen.arrived) * 1e9), "load_duration": gen.load_ns,
                "prompt_eval_count": n_prompt, "prompt_eval_duration": int((first - gen.t0) * 1e9),
                "eval_count": n_out, "eval_duration": int((end - first) * 1e9)}

    def body(self, gen: Generation, results: list[ChoiceResult]) -> dict:
        """The one reply of stream: false."""
        r = results[0]
        out = self.final(gen, r.finish_reason, r.num_prompt_tokens, r.num_output_tokens)
        out.update(self.piece(r.text, r.reasoning, r.tool_calls), **ollama_logprobs(gen, r.logprobs))
        return out

    async def stream(self, gen: Generation) -> AsyncIterator[str]:
        """A line per delta with text, reasoning or calls; the final line when the reply ends."""
        async for _, out in gen.outputs():
            if out.text or out.reasoning or out.tool_calls or (gen.req.logprobs and out.logprobs):
                yield json.dumps({"model": gen.model, "created_at": now_iso(),
                                  **self.piece(out.text, out.reasoning, out.tool_calls),
                                  **ollama_logprobs(gen, out.logprobs), "done": False}, ensure_ascii=False) + "\n"
            if out.finish_reason is not None:
                yield json.dumps(self.final(gen, out.finish_reason, out.num_prompt_tokens,
                                            out.num_output_tokens)) + "\n"

    def error(self, err: APIError) -> str:
        """An error line (Ollama's shape) after the stream started."""
        return json.dumps({"error": err.message}) + "\n"


async def _generate(request: Request, req: GenerationRequest, kind: str) -> Response:
    """Load / unload for an empty request, else the pipeline with Ollama's replier."""
    if (kind == "chat" and not req.messages) or (kind == "generate" and req.messages == [] and not req.prompts):
        return await _load_or_unload(request, req, kind)
    return await respond(request, req, OllamaReplier(kind))


@api_errors
async def chat(request: Request) -> Response:
    """POST /api/chat (NDJSON stream by default)."""
    return await _generate(request, await read_request(request, parse_ollama_chat), "chat")


@api_errors
async def generate(request: Request) -> Response:
    """POST /api/generate (NDJSON stream by default; raw: true skips the chat template)."""
    return await _generate(request, await read_request(request, parse_ollama_generate), "generate")


ROUTES = [
    Route("/api/chat", chat, methods=["POST"]),
    Route("/api/generate", generate, methods=["POST"]),
]
