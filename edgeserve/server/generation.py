"""One HTTP request's generation: prompts -> token ids -> SamplingParams -> engine streams, for every API."""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Callable

import anyio

from edgeserve.engine.outputs import RequestOutput, SpecCounters, TokenLogprob
from edgeserve.engine.sched.request_check import output_budget
from edgeserve.server.chat_setup import ChatSetup, can_think, chat_setup, format_stops
from edgeserve.server.thinking import MAX_BUDGET, thinking_spec
from edgeserve.server.disconnect import run_abandonable
from edgeserve.errors import InvalidRequestError
from edgeserve.sampling_params import SamplingParams
from edgeserve.server.errors import APIError, bad_request
from edgeserve.server.image_input import RequestImages, decode_inputs, encode_images, place_images
from edgeserve.server.image_parts import message_images
from edgeserve.server.metrics import Metrics
from edgeserve.server.model_manager import Lease
from edgeserve.server.output_limit import output_tokens
from edgeserve.server.prompt_bounds import check_prompt_size, max_token_chars, surely_too_long, too_long_error
from edgeserve.server.request import GenerationRequest
from edgeserve.text.chat_prompt import chat_prompt_ids

if TYPE_CHECKING:
    from starlette.requests import Request

log = logging.getLogger("edgeserve.server")


@dataclass
class ChoiceResult:
    """Everything one choice produced (for non-streaming replies and usage)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or end-of-turn token that ended it
    reasoning: str = ""
    tool_calls: list = field(default_factory=list)  # edgeserve.text.tool_calls.ToolCall
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0


@dataclass
class Usage:
    """Token counts of a whole request: each prompt once, every choice's output."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    spec: SpecCounters = field(default_factory=SpecCounters)  # speculative decoding's drafts, every choice's

    def as_openai(self) -> dict:
        """The OpenAI `usage` object; where drafts were verified, `completion_tokens_details` says how many were
        accepted and rejected (OpenAI's predicted-output fields) and in how many verification steps."""
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                 "total_tokens": self.prompt_tokens + self.completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        if self.spec.verifications:
            usage["completion_tokens_details"] = {
                "accepted_prediction_tokens": self.spec.accepted,
                "rejected_prediction_tokens": self.spec.proposed - self.spec.accepted,
                "speculative_verifications": self.spec.verifications}
        return usage


class Generation:
    """Submits a request's n x prompts engine requests and streams their deltas; close() cancels and releases."""

    def __init__(self, lease: Lease, req: GenerationRequest, metrics: Metrics, request_id: str,
                 prompt_param: str = "messages") -> None:
        self.lease, self.req, self.metrics, self.request_id = lease, req, metrics, request_id
        self.prompt_param = prompt_param
        self.model = lease.entry.id if req.adapter is None else req.adapter  # the name a reply echoes
        self.t0 = time.monotonic()  # when the model was leased
        self.arrived = self.t0  # when the request arrived (the pipeline sets it; Ollama's total_duration)
        self.load_ns = 0  # nanoseconds spent waiting for the model (Ollama's load_duration)
        self.created = int(time.time())
        self.streams: list = []
        self.prompt_lens: list[int] = []
        self.usage = Usage()
        self.first_token_at: float | None = None  # monotonic time of the first generated token (prefill done)
        self._closed = False
        self.on_close: list[Callable[[], None]] = []  # called once when it closes (server/live_requests.py)
        self.chat: ChatSetup | None = None  # chat replies: template inputs, constraint, output parsing
        self._prompts: list[list[int]] | None = None  # prompt_ids(), computed off the event loop by prepare()
        self._decoded: list | None = None  # the chat's images, decoded (PIL) by prepare()
        self._placed = None  # vision.prompt.ImagePrompt: the images placed in the prompt by prompt_ids()
        self.images: RequestImages | None = None  # the images encoded, as the engine request carries them

    def prompt_ids(self) -> list[list[int]]:
        """Token ids of each prompt: chat messages through the model's template, text encoded, ids checked."""
        lm = self.lease.lm
        tok = lm.tokenizer
        context = self.lease.engine.max_model_len
        if self.req.messages is not None:
            if self.chat is None:
                self.chat = self._chat_setup()
            self._refuse_if_surely_too_long(self.chat.prompt, context)
            if self._decoded:
                self._placed = place_images(self.chat.prompt, self._decoded, lm.vision, tok, self.prompt_param)
                return [self._placed.ids]
            return [chat_prompt_ids(tok, self.chat.prompt)]
        out = []
        for i, p in enumerate(self.req.prompts):
            if isinstance(p, str):
                self._refuse_if_surely_too_long(p, context)
            out.append(tok.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p))
        return out

    def _forced_schemas(self) -> list[dict]:
        """The parameter schemas a forced call (tool_choice "required" / a named function) must satisfy: compiled on
        their own, so a schema no output satisfies is a 400 even where the format's markup before the arguments
        offers choices that stop the compile-time probe short of them."""
        tools = self.chat.tools if self.chat is not None else None
        if tools is None or tools.mode != "forced":
            return []
        names = [tools.choice] if tools.choice is not None else sorted(tools.schemas)
        return [tools.schemas[n] for n in names if n in tools.schemas]

    def _chat_setup(self) -> ChatSetup:
        """The chat request's setup with the model's template (and the server's --tool-format)."""
        return chat_setup(self.req, self.lease.lm.chat_template, self.lease.manager.config.tool_format)

    def _refuse_if_surely_too_long(self, text: str, context: int) -> None:
        count = surely_too_long(self.lease.lm.tokenizer, text, context)
        if count:
            raise too_long_error(count, context, self.prompt_param)

    def _refuse_embedding_model(self) -> None:
        """A generation request naming an embedding model is a 400 (nothing stays leased)."""
        if getattr(self.lease.engine, "is_embedding", False):
            self.close()
            raise APIError(400, f"model {self.model!r} is an embedding model: use /v1/embeddings or /api/embed",
                           "invalid_request_error", "model", "model_not_supported")

    def submit(self) -> None:
        """Start every engine request; on an error nothing stays submitted and it is raised (before any response)."""
        from edgeserve.engine.async_engine import PromptTooLongError

        engine = self.lease.engine
        self._refuse_embedding_model()
        try:
            prompts = self._prompts if self._prompts is not None else self.prompt_ids()
            for p_idx, ids in enumerate(prompts):
                requested = output_tokens(self.req.max_tokens, self.lease.manager.config)  # the server's default/max
                max_tokens = output_budget(requested, len(ids), engine.max_model_len)
                if self.req.num_ctx is not None:
                    max_tokens = self._fit_num_ctx(ids, max_tokens)
                self.prompt_lens.append(len(ids))
                for j in range(self.req.n):
                    kw = self._sampling_fields()
                    if self.req.n > 1 and kw.get("seed") is not None:
                        kw["seed"] = kw["seed"] + j
                    params = SamplingParams(max_tokens=max_tokens, grammar=self.constraint(),
                                            thinking=thinking_spec(self.req.thinking_budget, self.chat,
                                                                   self.lease.lm.tokenizer), **kw)
                    # unique even when a client reuses an X-Request-Id; the log id stays a prefix
                    rid = f"{self.request_id}-{secrets.token_hex(3)}-{p_idx * self.req.n + j}"
                    extra = self.images.engine_args() if self.images is not None else {}
                    self.streams.append(engine.submit(ids, params, request_id=rid, adapter=self.req.adapter,
                                                      adapter_scale=self.req.adapter_scale, **extra))
        except PromptTooLongError as e:
            self.close()
            raise APIError(400, str(e), "invalid_request_error", self.prompt_param, "context_length_exceeded")
        except InvalidRequestError as e:  # the engine's one request check
            self.close()
            raise bad_request(str(e), self.prompt_param if e.param == "prompt" else e.param)
        except BaseException:
            self.close()
            raise

    def _sampling_fields(self) -> dict:
        """The request's SamplingParams fields over the model's recommended ones, with its chat format's stop
        strings (format_stops)."""
        stops = self.chat.stop if self.chat is not None else ()
        return format_stops({**self.lease.entry.sampling, **self.req.sampling}, stops,
                            self.lease.lm.tokenizer.token_to_id)

    def _fit_num_ctx(self, ids: list[int], max_tokens: int) -> int:
        """max_tokens capped to the request's own context window; a prompt that fills it is refused, never cut."""
        from edgeserve.engine.async_engine import PromptTooLongError

        ctx = self.req.num_ctx
        assert ctx is not None
        if len(ids) >= ctx:
            raise PromptTooLongError(f"the prompt has {len(ids)} tokens but the context is {ctx} tokens "
                                     "(options.num_ctx), which leaves no room to generate")
        return min(max_tokens, ctx - len(ids))
    def constraint(self):
        """The grammar every choice's reply must match (after any reasoning), or None."""
        return self.chat.constraint if self.chat is not None else self.req.constraint

    async def prepare(self) -> None:
        """Render and tokenize the prompts, and compile the request's grammar, off the event loop (a grammar is
        cached per model; the first use of a tokenizer takes ~1 s). A prompt surely past the context is refused
        before any of that (edgeserve.server.prompt_bounds); a schema the grammar engine cannot handle is a 400
        naming what is unsupported."""
        from edgeserve.text.grammar import GrammarCompiler, GrammarError, GrammarSpec

        self._refuse_embedding_model()
        lm = self.lease.lm
        if self.req.adapter is not None:  # read a LoRA adapter that is not resident here, not on the event loop
            await anyio.to_thread.run_sync(self.lease.engine.core.adapters.prefetch, self.req.adapter)
        try:
            if self.req.think_required and self.req.messages is not None and not can_think(lm.chat_template):
                raise APIError(400, f'"{self.model}" does not support thinking', "invalid_request_error", "think")
            await self.check_size()
            await self._decode_images()
            if self.req.messages is not None:
                self.chat = await anyio.to_thread.run_sync(self._chat_setup)
            spec = self.constraint()
            if spec is not None:  # a bad schema is reported before the prompt's length
                compiler = await anyio.to_thread.run_sync(GrammarCompiler.for_tokenizer, lm.tokenizer,
                                                          lm.config.vocab_size)
                await anyio.to_thread.run_sync(compiler.compile, spec)
                for schema in self._forced_schemas():  # a format's own markup may keep a dead schema from the probe
                    await anyio.to_thread.run_sync(compiler.compile, GrammarSpec.json_schema(schema))
            self._prompts = await anyio.to_thread.run_sync(self.prompt_ids)
            if self._placed is not None:  # off the loop: running streams keep their pace meanwhile
                self.images = await run_abandonable(encode_images, self._placed, lm.vision, self.decode_seconds)
        except GrammarError as e:
            self.close()
            forced = self.req.tool_choice not in ("none", "auto")
            raise bad_request(str(e), "tools" if forced else self.constraint_param) from None
        except BaseException:
            self.close()
            raise

    constraint_param = "response_format"  # the request field a grammar error names (Ollama routes: "format")
    decode_seconds = 0.0  # decoding the request's images

    async def _decode_images(self) -> None:
        """Decode the chat's images off the event loop (400s: a text-only model, limits, undecodable images)."""
        inputs = message_images(self.req.messages)
        if not inputs:
            return
        t0 = time.monotonic()
        self._decoded = await anyio.to_thread.run_sync(decode_inputs, inputs, self.lease.lm.vision, self.model,
                                                       self.lease.manager.config)
        self.decode_seconds = time.monotonic() - t0

    async def check_size(self) -> None:
        """400 context_length_exceeded for a prompt surely longer than the context, before it is rendered."""
        tok = self.lease.lm.tokenizer
        chars = getattr(tok, "_max_token_chars", None) or await anyio.to_thread.run_sync(max_token_chars, tok)
        check_prompt_size(self.req.messages, self.req.prompts, self.lease.engine.max_model_len, chars,
                          self.prompt_param)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, delta) for every choice in turn; records metrics; cancels what is left on exit.

        Chat replies are split into content, reasoning and tool calls here (`RequestOutput.reasoning`,
        `.tool_calls`; a reply that calls tools finishes with "tool_calls")."""
        try:
            for index, stream in enumerate(self.streams):
                first: float | None = None
                last: RequestOutput | None = None
                parser = self.chat.parser() if self.chat is not None else None
                async for out in stream:
                    if parser is not None:
                        self.chat.split(parser, out)
                    if first is None and out.token_ids:
                        first = time.monotonic() - self.t0
                        if self.first_token_at is None:
                            self.first_token_at = self.t0 + first
                    last = out
                    yield index, out
                if last is not None:
                    self._account(index, first, last)
        finally:
            self.close()

    async def collect(self) -> list[ChoiceResult]:
        """Run every choice to the end and return what each produced."""
        results = [ChoiceResult(i) for i in range(len(self.streams))]
        async for index, out in self.outputs():
            r = results[index]
            r.text += out.text
            r.reasoning += out.reasoning
            r.tool_calls += out.tool_calls or []
            r.token_ids += out.token_ids
            if out.logprobs:
                r.logprobs += out.logprobs
            r.finish_reason = out.finish_reason or r.finish_reason
            r.stop_reason = out.stop_reason if out.stop_reason is not None else r.stop_reason
            r.num_prompt_tokens, r.num_cached_tokens = out.num_prompt_tokens, out.num_cached_tokens
            r.num_output_tokens = out.num_output_tokens
        return results

    async def collect_unless_disconnected(self, request: "Request") -> list[ChoiceResult] | None:
        """collect(), but a client that goes away cancels the engine requests; None then."""
        results: list[ChoiceResult] | None = None

        async def watch(scope: anyio.CancelScope) -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            log.info("client disconnected; cancelling the request")
            self.close()
            scope.cancel()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch, tg.cancel_scope)
                results = await self.collect()
                tg.cancel_scope.cancel()
        finally:
            self.close()
        return results

    def _account(self, index: int, ttft: float | None, last: RequestOutput) -> None:
        e2e = time.monotonic() - self.t0
        if index % self.req.n == 0:  # each prompt counts once
            self.usage.prompt_tokens += last.num_prompt_tokens
            self.usage.cached_tokens += last.num_cached_tokens
        self.usage.completion_tokens += last.num_output_tokens
        if last.spec is not None:
            self.usage.spec.merge(last.spec)
        self.metrics.observe_request(self.model, ttft, e2e, last.num_prompt_tokens, last.num_cached_tokens,
                                     last.num_output_tokens)
        log.info("choice %d of %s: %d prompt tokens (%d cached), %d generated, finish %s, ttft %s, %.3fs",
                 index, self.model, last.num_prompt_tokens, last.num_cached_tokens, last.num_output_tokens,
                 last.finish_reason, f"{ttft:.3f}s" if ttft is not None else "-", e2e)

    def close(self) -> None:
        """Abort unfinished engine requests (freeing their KV blocks) and release the model (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for s in self.streams:
            s.abort()
        self.lease.release()
        for callback in self.on_close:
            callback()

    def end_thinking(self) -> int:
        """Close every running choice's thought at its next step, so the answer follows now (whatever is left of a
        thinking budget); the number of choices that were thinking (0: none is, or the model does not reason)."""
        budget = self.req.thinking_budget if self.req.thinking_budget is not None else MAX_BUDGET
        spec = thinking_spec(budget, self.chat, self.lease.lm.tokenizer)
        if spec is None or self._closed:
            return 0
        return sum(self.lease.engine.end_thinking(s.request_id, spec) for s in self.streams if not s.finished)

    async def aclose(self) -> None:
        """close() on the event loop (for a response's background task: a sync one would run in a thread)."""
        self.close()

    def token_text(self, token_id: int) -> str:
        """One token's text as the tokenizer decodes it alone (for logprobs)."""
        return self.lease.lm.tokenizer.decode([token_id])
