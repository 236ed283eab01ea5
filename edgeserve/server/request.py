"""GenerationRequest: what every generation route parses its API's body into, and the pipeline runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edgeserve.server.config import UNSET
from edgeserve.text.grammar import GrammarSpec


@dataclass
class GenerationRequest:
    """What the API adapters hand to the pipeline (edgeserve/server/respond.py): a prompt and everything about how
    to continue it. Chat messages are in one shape whatever the API (edgeserve/server/messages.py): role, content,
    and where present tool_calls, tool_call_id / tool_name, name and reasoning_content."""

    model: str
    messages: list[dict[str, Any]] | None = None  # chat: rendered with the model's template
    prompts: list[str | list[int]] = field(default_factory=list)  # completions / raw: text or token ids
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields except max_tokens
    max_tokens: int | None = None  # None: up to the context length
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    resumable: bool = False  # stream_options.resumable: the stream runs on without its client (server/detached_runs.py)
    logprobs: bool = False  # chat: report logprobs
    keep_alive: Any = UNSET  # seconds or None (forever); UNSET: the server default
    num_ctx: int | None = None  # this request's context window (Ollama options.num_ctx); None: the model's
    # structured output, tools and reasoning (tools parsed by edgeserve/server/tools.py; see chat_setup)
    constraint: GrammarSpec | None = None  # response_format / Ollama format: the answer must match it
    tools: list[dict] | None = None  # OpenAI-shaped function definitions
    tool_choice: str | dict = "none"  # "none" | "auto" | "required" | {"name": function}
    parallel_tool_calls: bool | None = None  # False: at most one call per reply; None: not said (several calls
    # under "auto", one under "required"); True: several (at most chat_setup.MAX_PARALLEL_CALLS under "required")
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # extra chat template variables
    think: bool | None = None  # reasoning on/off (Ollama think, enable_thinking); None: the template's default
    think_required: bool = False  # a model that cannot think is a 400 (Ollama think: true / a level)
    # llama-server's reasoning_format: "none" keeps the reasoning in the content (tags and all); "auto" / "deepseek"
    # (and None) split it into the reasoning field
    reasoning_format: str | None = None
    # assistant prefill (edgeserve.text.continuation): the conversation ends with an assistant message the reply
    # continues; "content" / "reasoning" (its content, or its reasoning), "auto" (the reasoning when the message has
    # reasoning and no content), None: a new assistant turn. add_generation_prompt false (and no continuation):
    # the prompt is the conversation alone, without the template's assistant header
    continue_final_message: str | None = None
    add_generation_prompt: bool = True
    # reasoning tokens before the model's closing tag is forced and the answer follows (server/thinking.py); None: no
    # budget
    thinking_budget: int | None = None
    # LoRA (edgeserve/server/adapters.py): the adapter it runs and its scale; `lora` is llama-server's raw list
    adapter: str | None = None
    adapter_scale: float = 1.0
    lora: list[Any] | None = None
