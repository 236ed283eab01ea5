"""What one model family's reply format is: how its template is recognised, where its tool calls start, how they
read back, its reasoning tags, its extra stop strings and the grammar of a forced call in its own syntax.

Each family is one module in this package that defines one `ChatFormat` (or a few) and lists it in
`edgeserve.text.formats.MODULES`; `detect_format` is a lookup over that list.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from edgeserve.text.grammar import GrammarSpec


@dataclass
class ToolCall:
    """One parsed call: `arguments` is JSON text (as OpenAI sends it)."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = "call_" + secrets.token_hex(12)

    def openai(self, index: int | None = None) -> dict[str, Any]:
        """The OpenAI `tool_calls` item (with `index` for stream deltas)."""
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}

    def ollama(self) -> dict[str, Any]:
        """The Ollama `tool_calls` item (arguments as an object)."""
        try:
            args = json.loads(self.arguments)
        except json.JSONDecodeError:
            args = self.arguments
        return {"function": {"name": self.name, "arguments": args}}


@dataclass
class CallContext:
    """What a call parser knows of the request: the functions it offered (`known`; calls to other names stay
    text) and their parameter schemas (`schemas`, name -> JSON schema), for formats that write values as text."""

    known: set[str] = field(default_factory=set)
    schemas: dict[str, dict] = field(default_factory=dict)


# (reply text from the first call marker on, context) -> (content left over, calls read). A parser must not lose
# text: what is not a call comes back as content, in order.
CallParser = Callable[[str, CallContext], "tuple[str, list[ToolCall]]"]
# (reply text cut short by max_tokens, from its first call marker on, context) -> its calls: the complete ones (a
# forced reply's), then the cut one when its name is complete, with its arguments as far as they got (JSON text,
# perhaps unfinished). Used for forced replies and, in auto mode, for held text the parser read no call from.
CutReader = Callable[[str, CallContext], "list[ToolCall]"]
# (tools, choice: a function name or None for "required", parallel) -> the grammar that constrains the reply to
# calls in the format's own syntax.
ForcedGrammar = Callable[[list[dict], "str | None", bool], "GrammarSpec"]


@dataclass(frozen=True)
class ChatFormat:
    """One family's tool-call and reasoning format."""

    name: str
    detect: Callable[[str], bool]  # chat template source -> whether the template writes this format
    call_markers: tuple[str, ...] = ()  # text that starts a call; content is held back from the first one
    parse: CallParser | None = None  # None: the format has no tool calls
    reasoning: tuple[str, str] | None = None  # (open, close) tags of its thoughts; None: the generic <think> rule
    calls_in_reasoning: bool = False  # a call marker inside an unclosed thought ends the thought there
    stop: tuple[str, ...] = ()  # strings that end the reply besides the vocabulary's end-of-turn tokens
    forced: ForcedGrammar | None = None  # None: forced calls use the generic JSON reply (tool_calls.forced_schema)
    cut: CutReader | None = None  # reads a reply cut short inside a call (None: such text stays content)
    thinking_switches: tuple[str, ...] = ("enable_thinking",)  # template variables that turn reasoning on / off
    priority: int = 100  # detection order: lower is tried first (specific markers before generic ones)
    # markers of the format that are never content: removed from the content wherever they appear (Gemma 4's stray
    # `<channel|>`); longer ones are matched first. Kept when the request asks for raw reasoning (reasoning_format
    # "none").
    stray: tuple[str, ...] = ()
    # the system-prompt text that lists the tools in the family's own words, for a template that writes calls and
    # results natively but never lists the tools (DeepSeek V3.1, R1 distills); None: the template lists them, or
    # (a template that knows no tools) edgeserve's generic hermes prompt
    tools_prompt: Callable[[list[dict]], str] | None = None
    # its call markers include answer markup (Command R7B's `<|START_RESPONSE|>`, Kimi K3's response section) that
    # its parser takes off the content, with or without tools, and that ends a thought the prompt opened
    wraps_answer: bool = False
    # under reasoning_format "none" the thought's tags are taken off and its text kept as content, the rest read as
    # without it (Ling 3's and Kimi K3's replies, as llama.cpp's parsers for them do); False: the thought stays in
    # the content as written, tags and all, after the tag the prompt opened
    raw_thought_untagged: bool = False
    # the thought's open "tag" is prose the reasoning starts with (Apriel 1.6's "Here are my reasoning steps:\n"):
    # returned as the reasoning's first words, also when the prompt wrote it
    open_tag_is_reasoning: bool = False
    # variables the template reads besides `tools`, from the request's tools (None without): firefunction v2's
    # `functions` and `datetime`, which its model card has callers pass; a format with them writes calls natively
    template_vars: Callable[[list[dict] | None], dict[str, Any]] | None = None
    # an assistant message's calls (arguments as objects) as the model writes them, for a template that lists the
    # tools but never renders `tool_calls` (LFM2's, LFM2.5-Instruct's): history calls go into the content as this
    # text; None: the template renders them (or the generic rewrite applies)
    history_calls: Callable[[list[dict]], str] | None = None
