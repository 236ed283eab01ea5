"""A chat request's prompt, constraint and reply parsing, from its tools / tool_choice / format / reasoning fields.

This is the one place that turns `GenerationRequest` (messages, tools, tool_choice, parallel_tool_calls,
constraint, template_kwargs, think) into what the engine runs and how the reply is read back:

- the prompt: the model's chat template gets `tools` (or, if it knows none, a system-prompt block, see
  edgeserve.text.tool_calls) and `template_kwargs` (`enable_thinking` from `think`);
- the constraint: `response_format` / Ollama `format`, or with tool_choice "required" / a named function the
  grammar of the tools' schemas; for a model that reasons it applies after `</think>`;
- the reply: reasoning split from content, tool calls parsed (template's format under "auto").

A model whose template is harmony (gpt-oss, edgeserve.text.harmony) is rendered by edgeserve itself, with the
reasoning effort from `template_kwargs["reasoning_effort"]` (the routes put OpenAI `reasoning_effort`, Responses
`reasoning.effort`, Ollama `think` levels and Anthropic thinking there) or `think`; its constraints wrap the final
message / the forced call in harmony's frame, and its replies are read by `HarmonyParser`.

Other routes (Anthropic messages, Responses) can fill the same request fields and read `RequestOutput.reasoning`
/ `.tool_calls` (or `ChoiceResult.reasoning` / `.tool_calls`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from edgeserve.engine.outputs import RequestOutput
from edgeserve.loaders.chat_template import ChatTemplate
from edgeserve.server.request import GenerationRequest
from edgeserve.text.chat_output import ChatOutputParser, ToolSetup
from edgeserve.text.grammar import GrammarSpec, json_rule
from edgeserve.text.harmony import (HarmonyParser, harmony_options, render_harmony, template_is_harmony,
                                    tool_call_grammar)
from edgeserve.text.reasoning import (THINK_CLOSE, THINK_OPEN, ReasoningSplitter, prompt_opens_thought,
                                      reasoning_tags, template_thinks)
from edgeserve.text.partial_calls import cut_forced_calls
from edgeserve.text.tool_calls import (NATIVE_FORCED, detect_format, forced_schema, function_parameters,
                                       messages_for_template, template_knows_tools)
from edgeserve.text.xml_tool_calls import CALL_TAGS, forced_call_grammar

# Calls one reply may make under tool_choice "required" with parallel_tool_calls true (one without it): a
# random-weights or looping model must not emit calls until max_tokens.
MAX_PARALLEL_CALLS = 16


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

    def parser(self) -> ChatOutputParser | HarmonyParser | None:
        """A fresh parser for one reply (None when there is nothing to split)."""
        if self.harmony:
            tools = self.tools or ToolSetup("auto")
            return HarmonyParser(tools.known, tools.parallel)
        if not self.thinks and self.tools is None:
            return None
        return ChatOutputParser(ReasoningSplitter(self.in_thought, *self.tags) if self.thinks else None, self.tools)

    def split(self, parser: ChatOutputParser | HarmonyParser | None, out: RequestOutput) -> None:
        """Rewrite one delta in place: `text` becomes content, with `reasoning` and (at the end) `tool_calls`.
        A forced call cut short by max_tokens still comes back as a call, with the arguments it got to."""
        if parser is None:
            return
        out.reasoning, out.text = parser.push(out.text)
        if out.finish_reason is not None:
            thought, content, calls = parser.finish()
            out.reasoning += thought
            forced = self.tools is not None and self.tools.mode == "forced" and not self.harmony
            if forced and not calls and out.finish_reason == "length":
                calls = cut_forced_calls(content, self.tools.choice)
                content = "" if calls else content
            out.text += content
            out.tool_calls = calls
            if calls and out.finish_reason == "stop":
                out.finish_reason = "tool_calls"


def chat_setup(req: GenerationRequest, template: ChatTemplate) -> ChatSetup:
    """Render the prompt of a chat request and decide its constraint and reply parsing."""
    source = template.source
    tools = req.tools if req.tool_choice != "none" else None
    if template_is_harmony(source):
        return _harmony_setup(req, tools)
    kwargs: dict[str, Any] = dict(req.template_kwargs)
    if req.think is not None:
        kwargs["enable_thinking"] = req.think
    if tools and template_knows_tools(source):
        kwargs["tools"] = tools
    prompt = template.render(messages_for_template(req.messages or [], tools, source), add_generation_prompt=True,
                             **kwargs)
    # a template that closed the reasoning in the prompt (Qwen3 with enable_thinking false) expects none
    tags = reasoning_tags(source) or (THINK_OPEN, THINK_CLOSE)
    thinks = template_thinks(source) and req.think is not False and not prompt.rstrip().endswith(tags[1])
    in_thought = thinks and prompt_opens_thought(prompt, tags[0])
    constraint = req.constraint
    tool_setup = None
    if tools:
        names = {t["function"]["name"] for t in tools}
        schemas = {t["function"]["name"]: function_parameters(t) for t in tools}
        fmt = detect_format(source)
        if req.tool_choice == "auto":
            tool_setup = ToolSetup("auto", fmt, names, parallel=req.parallel_tool_calls is not False, schemas=schemas)
        else:
            choice = req.tool_choice["name"] if isinstance(req.tool_choice, dict) else None
            parallel = req.parallel_tool_calls is True
            if fmt in NATIVE_FORCED:
                grammar = forced_call_grammar(tools, choice, parallel, json_rule)
                constraint = GrammarSpec("lark", grammar, tokens=CALL_TAGS)
            else:
                constraint = GrammarSpec.json_schema(required_schema(tools, choice, req.parallel_tool_calls))
            tool_setup = ToolSetup("forced", fmt, names, choice, parallel, schemas)
    if constraint is not None and thinks:
        constraint = replace(constraint, think=("" if in_thought else tags[0], tags[1]))
    return ChatSetup(prompt, constraint, thinks, in_thought, tool_setup, tags)


def _harmony_setup(req: GenerationRequest, tools: list[dict] | None) -> ChatSetup:
    """chat_setup for a harmony model: edgeserve's harmony rendering, harmony-framed constraints, HarmonyParser."""
    prompt = render_harmony(req.messages or [], tools, harmony_options(req.template_kwargs, req.think))
    constraint = replace(req.constraint, harmony=True) if req.constraint is not None else None
    tool_setup = None
    if tools:
        names = {t["function"]["name"] for t in tools}
        forced = req.tool_choice != "auto"
        if forced:
            choice = req.tool_choice["name"] if isinstance(req.tool_choice, dict) else None
            constraint = GrammarSpec("lark", tool_call_grammar(tools, choice, json_rule))
        tool_setup = ToolSetup("forced" if forced else "auto", "harmony", names,
                               parallel=req.parallel_tool_calls is not False)
    return ChatSetup(prompt, constraint, True, True, tool_setup, harmony=True)


def required_schema(tools: list[dict], choice: str | None, parallel: bool | None) -> dict:
    """The forced reply's schema (forced_schema), its calls bounded: one unless the request said
    parallel_tool_calls true, then at most MAX_PARALLEL_CALLS."""
    schema = forced_schema(tools, choice, parallel is True)
    if choice is None and parallel is True:
        schema["maxItems"] = MAX_PARALLEL_CALLS
    return schema


def can_think(template: ChatTemplate) -> bool:
    """Whether the model's template writes reasoning (<think> tags, or harmony's analysis channel)."""
    return template_thinks(template.source) or template_is_harmony(template.source)
