"""A chat request's prompt, constraint and reply parsing, from its tools / tool_choice / format / reasoning fields.

This is the one place that turns `GenerationRequest` (messages, tools, tool_choice, parallel_tool_calls,
constraint, template_kwargs, think) into what the engine runs and how the reply is read back:

- the format: the template's reply format from the registry (edgeserve.text.formats.detect_format), or the one
  the server was told (`--tool-format`);
- the prompt: the model's chat template (its tokenizer's named `tool_use` template for a request with tools, when
  it has one) gets `tools` (or, if it knows none, a tools block in the system prompt, see
  edgeserve.text.tool_calls) and `template_kwargs` (`think` as every reasoning switch the template reads,
  edgeserve.text.thinking_switch);
- the constraint: `response_format` / Ollama `format`, or with tool_choice "required" / a named function the
  format's own grammar of forced calls (else the generic JSON reply); for a model that reasons it applies after
  the thought;
- the reply: reasoning split from content by the format's tags (kept in the content under reasoning_format
  "none"), tool calls parsed by the format's parser, its stray markers dropped, its stop strings passed on;
- assistant prefill (`continue_final_message`, edgeserve.text.continuation): the prompt ends inside the final
  assistant message; the reply is read from where it stops (a content continuation has no thought to split, a
  reasoning continuation starts inside the thought) and returns only the continuation (`ChatSetup.prefilled` is
  what comes before it); a constraint (response_format, forced calls) applies to the continuation alone, after
  the thought when reasoning is continued. `add_generation_prompt` false renders the conversation alone.

A model whose template is harmony (gpt-oss, edgeserve.text.harmony) is rendered by edgeserve itself, with the
reasoning effort from `template_kwargs["reasoning_effort"]` (the routes put OpenAI `reasoning_effort`, Responses
`reasoning.effort`, Ollama `think` levels and Anthropic thinking there) or `think`; its constraints wrap the final
message / the forced call in harmony's frame, and its replies are read by `HarmonyParser`.

Other routes (Anthropic messages, Responses) can fill the same request fields and read `RequestOutput.reasoning`
/ `.tool_calls` (or `ChoiceResult.reasoning` / `.tool_calls`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from edgeserve.engine.outputs import RequestOutput
from edgeserve.errors import ChatTemplateError
from edgeserve.loaders.chat_template import ChatTemplate
from edgeserve.sampling_params import SamplingParams
from edgeserve.server.request import GenerationRequest
from edgeserve.text.chat_output import ChatOutputParser, ToolSetup
from edgeserve.text.continuation import CONTENT, REASONING, continuation_kind, render_continuation
from edgeserve.text.formats import CallContext, ChatFormat, ToolCall, detect_format, get_format
from edgeserve.text.formats import FALLBACK as FALLBACK_FORMAT
from edgeserve.text.formats.markup import MAX_PARALLEL_CALLS  # the bound of calls in every forced grammar
from edgeserve.text.grammar import GrammarSpec, json_rule
from edgeserve.text.harmony import (HarmonyParser, harmony_options, render_continued_harmony, render_harmony,
                                    template_is_harmony, tool_call_grammar)
from edgeserve.text.reasoning import (THINK_CLOSE, THINK_OPEN, ReasoningSplitter, format_reasoning_tags,
                                      prompt_opens_thought)
from edgeserve.text.partial_calls import cut_forced_calls
from edgeserve.text.thinking_switch import thinking_kwargs
from edgeserve.text.tool_calls import forced_schema, function_parameters, messages_for_template, template_knows_tools


@dataclass
class ChatSetup:
    """What one chat request renders and how its replies are read."""

    prompt: str
    constraint: GrammarSpec | None
    thinks: bool  # the reply may start with reasoning to split off
    in_thought: bool  # the prompt opened the reasoning
    tools: ToolSetup | None
    tags: tuple[str, str] = (THINK_OPEN, THINK_CLOSE)  # the reasoning's open and close tags
    harmony: bool = False  # the reply is harmony: HarmonyParser reads it
    fmt: ChatFormat | None = None  # the template's reply format (stray markers, calls inside a thought)
    stop: tuple[str, ...] = ()  # the format's stop strings: the engine request ends at any of them
    raw_reasoning: bool = False  # reasoning_format "none": the reasoning stays in the content, tags and all
    opened: str = ""  # the thought the prompt opened (its tag as the prompt wrote it), shown first when raw
    # assistant prefill: the final message's (reasoning, content) the reply continues; the reply returns only the
    # continuation, these come before it in the whole message
    prefilled: tuple[str, str] = ("", "")
    continued: str | None = None  # what the reply continues: "content", "reasoning", None (a new turn)

    def parser(self) -> ChatOutputParser | HarmonyParser | None:
        """A fresh parser for one reply (None when there is nothing to split)."""
        if self.harmony:
            tools = self.tools or ToolSetup("auto")
            parser = HarmonyParser(tools.known, tools.parallel, raw_reasoning=self.raw_reasoning)
            return parser.continuing(self.continued == REASONING) if self.continued else parser
        untagged = self.raw_reasoning and self.fmt is not None and self.fmt.raw_thought_untagged
        raw = self.raw_reasoning and not untagged  # the thought stays in the content as written
        splits = self.thinks and not raw
        stray = self.fmt.stray if self.fmt is not None and not raw else ()
        prefix = self.opened if raw and self.in_thought else ""
        if not splits and self.tools is None and not stray and not prefix:
            return None
        splitter = None
        if splits:
            calls_end_it = self.fmt is not None and self.fmt.calls_in_reasoning and self.tools is not None \
                and self.tools.format is self.fmt and (bool(self.tools.known) or self.fmt.wraps_answer)
            ends = self.tools.format.call_markers if calls_end_it else ()
            keep_open = self.fmt is not None and self.fmt.open_tag_is_reasoning
            splitter = ReasoningSplitter(self.in_thought, *self.tags, ends=ends, keep_open=keep_open,
                                         trim=not untagged,
                                         continued=self.continued == REASONING and bool(self.prefilled[0]))
        return ChatOutputParser(splitter, self.tools, stray, prefix, thought_as_content=untagged)

    def split(self, parser: ChatOutputParser | HarmonyParser | None, out: RequestOutput) -> None:
        """Rewrite one delta in place: `text` becomes content, with `reasoning` and (at the end) `tool_calls`.
        A call cut short by max_tokens still comes back as a call, with the arguments it got to (forced: the generic
        JSON's; auto: where the format has a `cut` reader)."""
        if parser is None:
            return
        out.reasoning, out.text = parser.push(out.text)
        if out.finish_reason is not None:
            thought, content, calls = parser.finish(cut=out.finish_reason == "length") \
                if isinstance(parser, ChatOutputParser) else parser.finish()
            out.reasoning += thought
            forced = self.tools is not None and self.tools.mode == "forced" and not self.harmony
            if forced and out.finish_reason == "length":
                cut = self._cut_calls(content)
                calls, content = (calls + cut, "") if cut else (calls, content)
            out.text += content
            out.tool_calls = calls
            if calls and out.finish_reason == "stop":
                out.finish_reason = "tool_calls"

    def _cut_calls(self, content: str) -> list[ToolCall]:
        """The calls of a forced reply cut short by max_tokens (the content left after its complete calls were
        read): by the format's cut reader, or the generic JSON reply's."""
        fmt = self.tools.format
        if fmt.forced is None:
            return cut_forced_calls(content, self.tools.choice)
        return fmt.cut(content, CallContext(set(self.tools.known), dict(self.tools.schemas))) if fmt.cut else []


def chat_setup(req: GenerationRequest, template: ChatTemplate, tool_format: str | None = None) -> ChatSetup:
    """Render the prompt of a chat request and decide its constraint and reply parsing. `tool_format`: the name of
    a registered format that replaces the one detected from the template (`--tool-format`)."""
    tools = req.tools if req.tool_choice != "none" else None
    if tools and template.tool_use is not None:  # the tokenizer's own template for requests with tools
        template = template.tool_use
    source = template.source
    kind = continuation_kind(req.messages[-1], req.continue_final_message) \
        if req.continue_final_message and req.messages else None
    if template_is_harmony(source):
        return _harmony_setup(req, tools, kind)
    fmt = get_format(tool_format) if tool_format is not None else detect_format(source)
    kwargs: dict[str, Any] = dict(req.template_kwargs)
    if req.think is not None:
        switches = thinking_kwargs(req.think, source, fmt.thinking_switches)
        kwargs.update({k: v for k, v in switches.items() if k == "enable_thinking" or k not in req.template_kwargs})
    knows_tools = template_knows_tools(source) or fmt.template_vars is not None
    if tools and knows_tools:
        kwargs["tools"] = tools
    if fmt.template_vars is not None:  # firefunction v2's `functions` / `datetime`, unless the request set them
        kwargs.update({k: v for k, v in fmt.template_vars(tools).items() if k not in req.template_kwargs})
    native_calls = knows_tools or fmt.tools_prompt is not None  # the template writes calls in its own syntax
    system_role = knows_tools or not tools or template.accepts_system()  # asked only where our block goes in
    object_arguments = not _has_calls(req.messages) or template.accepts_object_arguments()
    messages = messages_for_template(req.messages or [], tools, source, system_role=system_role,
                                     tools_prompt=fmt.tools_prompt, native=knows_tools,
                                     object_arguments=object_arguments, history_calls=fmt.history_calls)
    tags = format_reasoning_tags(fmt.reasoning, source)
    if kind is not None:
        prompt = render_continuation(template, messages, kind, tags[0] if tags else None, **kwargs)
    else:
        prompt = template.render(messages, add_generation_prompt=req.add_generation_prompt, **kwargs)
    thinks, in_thought, closed = _thought_state(prompt, tags)
    if kind is not None:  # the reply continues the answer (its thought, if any, is over) or the thought
        thinks = in_thought = kind == REASONING
        closed = False
    prefilled = _prefilled(req.messages, kind, tags is not None and req.reasoning_format != "none")
    tags = tags or (THINK_OPEN, THINK_CLOSE)
    constraint = req.constraint
    tool_setup = None
    if tools:
        # our tools prompt (a template that knows no tools) asks for hermes calls; so does a format without calls
        call_fmt = fmt if (native_calls or tool_format is not None) and fmt.parse is not None \
            else get_format(FALLBACK_FORMAT)
        tool_setup, forced = _tool_setup(req, tools, call_fmt)
        constraint = forced or constraint
    elif fmt.wraps_answer and fmt.parse is not None and not req.constraint:
        # no tools offered: nothing is read as a call, but a family's answer markup (Command R7B's
        # `<|START_RESPONSE|>`, Kimi K3's response section) is still taken off the content by its parser
        tool_setup = ToolSetup("auto", fmt, set(), parallel=False)
    # reasoning off: the constrained reply starts at once; a grammar that owns its thought is never wrapped
    if constraint is not None and thinks and not closed and not constraint.own_thought:
        constraint = replace(constraint, think=("" if in_thought else tags[0], tags[1]))
    opened = prompt[prompt.rstrip().rfind(tags[0].strip()):] if in_thought and kind is None else ""
    return ChatSetup(prompt, constraint, thinks, in_thought, tool_setup, tags, fmt=fmt, stop=fmt.stop,
                     raw_reasoning=req.reasoning_format == "none", opened=opened, prefilled=prefilled,
                     continued=kind)


def _prefilled(messages: list[dict[str, Any]] | None, kind: str | None, splits: bool) -> tuple[str, str]:
    """(reasoning, content) of the final message that a continuation of `kind` continues: its reply so far (the
    reasoning only where the reply's reasoning is split off; none of the content for a reasoning continuation)."""
    if kind is None or not messages:
        return "", ""
    message = messages[-1]
    reasoning = (message.get("reasoning_content") or "") if splits else ""
    return reasoning, (message.get("content") or "") if kind == CONTENT else ""


def _has_calls(messages: list[dict] | None) -> bool:
    """Whether an assistant message of the conversation made tool calls (only then do their arguments' type
    matter to the template)."""
    return any(m.get("tool_calls") for m in messages or [])


def _thought_state(prompt: str, tags: tuple[str, str] | None) -> tuple[bool, bool, bool]:
    """(thinks, in_thought, closed) of a rendered prompt: the reply may start with reasoning unless the template
    does not reason; it starts inside one when the prompt opened it; `closed` when the prompt closed an empty thought
    itself (reasoning off: Qwen3's `<think></think>`, Command R7B's `<|START_THINKING|><|END_THINKING|>`). A model
    that thinks anyway (its reply opens the tag again), or whose template always opens a thought (DeepSeek-R1
    distills, MiniMax M2), gets that thought back as reasoning, never as content."""
    if tags is None:
        return False, False, False
    closed = prompt.rstrip().endswith(tags[1].strip())
    return True, not closed and prompt_opens_thought(prompt, *tags), closed


def _tool_setup(req: GenerationRequest, tools: list[dict], fmt: ChatFormat) -> tuple[ToolSetup, GrammarSpec | None]:
    """How the reply's calls are read, and under tool_choice "required" / a named function the grammar that forces
    them (the format's own, else the generic JSON reply)."""
    names = {t["function"]["name"] for t in tools}
    schemas = {t["function"]["name"]: function_parameters(t) for t in tools}
    if req.tool_choice == "auto":
        return ToolSetup("auto", fmt, names, parallel=req.parallel_tool_calls is not False, schemas=schemas), None
    choice = req.tool_choice["name"] if isinstance(req.tool_choice, dict) else None
    parallel = req.parallel_tool_calls is True
    if fmt.forced is not None:
        constraint = fmt.forced(tools, choice, parallel)
    else:
        constraint = GrammarSpec.json_schema(required_schema(tools, choice, req.parallel_tool_calls))
    return ToolSetup("forced", fmt, names, choice, parallel, schemas), constraint


def _harmony_setup(req: GenerationRequest, tools: list[dict] | None, kind: str | None) -> ChatSetup:
    """chat_setup for a harmony model: edgeserve's harmony rendering, harmony-framed constraints, HarmonyParser.
    A continued message (`kind`) takes no constraint: harmony's frame the grammars write is already open."""
    options = harmony_options(req.template_kwargs, req.think)
    if kind is None:
        prompt = render_harmony(req.messages or [], tools, options)
    elif req.constraint is not None or (tools and req.tool_choice != "auto"):
        raise ChatTemplateError("a harmony (gpt-oss) model cannot continue an assistant message under "
                                "response_format or a forced tool_choice")
    else:
        prompt = render_continued_harmony(req.messages or [], tools, options, kind == REASONING)
    constraint = replace(req.constraint, harmony=True) if req.constraint is not None else None
    tool_setup = None
    if tools:
        names = {t["function"]["name"] for t in tools}
        forced = req.tool_choice != "auto"
        if forced:
            choice = req.tool_choice["name"] if isinstance(req.tool_choice, dict) else None
            constraint = GrammarSpec("lark", tool_call_grammar(tools, choice, json_rule))
        tool_setup = ToolSetup("forced" if forced else "auto", known=names,
                               parallel=req.parallel_tool_calls is not False)
    return ChatSetup(prompt, constraint, True, True, tool_setup, harmony=True,
                     prefilled=_prefilled(req.messages, kind, True), continued=kind,
                     raw_reasoning=req.reasoning_format == "none")


def format_stops(sampling: dict[str, Any], stops: tuple[str, ...],
                 token_to_id: Callable[[str], int | None]) -> dict[str, Any]:
    """SamplingParams fields `sampling` with a format's stop strings added: one that is a single token of the
    vocabulary ends the reply as a stop token (its text is never shown, as llama.cpp ends Gemma 4's turn at
    `<|tool_response>`), others as stop strings (as many as the request's limit leaves room for)."""
    kw = dict(sampling)
    if not stops:
        return kw
    stop = kw.get("stop") or []
    stop, ids = [stop] if isinstance(stop, str) else list(stop), list(kw.get("stop_token_ids") or [])
    for s in stops:
        i = token_to_id(s)
        if i is not None and i not in ids:
            ids.append(i)
        elif i is None and s not in stop and len(stop) < SamplingParams.MAX_STOP:
            stop.append(s)
    kw["stop"], kw["stop_token_ids"] = stop, ids
    return kw


def required_schema(tools: list[dict], choice: str | None, parallel: bool | None) -> dict:
    """The forced reply's schema (forced_schema), its calls bounded: one unless the request said
    parallel_tool_calls true, then at most MAX_PARALLEL_CALLS."""
    schema = forced_schema(tools, choice, parallel is True)
    if choice is None and parallel is True:
        schema["maxItems"] = MAX_PARALLEL_CALLS
    return schema


def can_think(template: ChatTemplate) -> bool:
    """Whether the model's template writes reasoning (<think> tags, its format's own, or harmony's analysis
    channel)."""
    from edgeserve.text.reasoning import template_thinks

    return template_thinks(template.source) or template_is_harmony(template.source)
