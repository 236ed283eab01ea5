"""OpenAI's harmony format (gpt-oss): prompts rendered, replies split into reasoning, content and tool calls,
and the grammar frame that constrains a harmony reply.

A harmony conversation is a run of messages `<|start|>{header}<|message|>{content}<|end|>`; the header holds the
role, a recipient (` to=functions.NAME`), a channel (`<|channel|>analysis|commentary|final`) and a content type
(` json` / ` <|constrain|>json`). A reply starts right after the prompt's `<|start|>assistant`: reasoning on the
`analysis` channel, the answer on `final`, a tool call on `commentary` addressed to `functions.NAME`; the turn ends
with `<|return|>` (answer) or `<|call|>` (tool call), the model's stop tokens (`<|end|>` only separates messages
inside the turn: edgeserve.loaders.tokenizer never makes it end-of-turn for such a vocabulary).

Why edgeserve renders harmony itself instead of running the model's Jinja template:

- the format is fixed and documented (openai/harmony's docs/format.md and its renderer library, the reference
  renderer of the format gpt-oss was trained on), while the Jinja copies drift from it: GGUFs carry the first
  published template or patched community ones, and the current official one still differs from the reference
  renderer (it JSON-quotes tool results, `"{\\"temp\\": 20}"`; renders only the first of several parallel
  calls; puts a comma after a parameter's `// default:` comment; ends a developer message that has instructions
  but no tools with a blank line, where openai/harmony's docs/format.md and renderer end it right after the
  instructions). edgeserve follows the reference in each of these;
- the server must understand the format anyway, to parse replies and build grammars, and a request's fields map
  onto it directly (reasoning effort onto `Reasoning:`, `reasoning_content` onto the analysis of a tool-calling
  turn) without template-variable conventions (`thinking`, `reasoning_effort`, `builtin_tools`).

Everything else is the official template's rendering, byte for byte (tests/text/test_harmony.py renders the same
conversations through a copy of it, tests/gpt_oss_chat_template.jinja, and checks the differences above one by
one): the system message (identity, knowledge cutoff, current date, `Reasoning:`, the valid channels), the
developer message (`# Instructions` from the first system/developer message, `# Tools` as a TypeScript-like
`namespace functions`), earlier reasoning dropped except for tool-calling turns not yet answered, tool calls as
`<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{args}<|call|>`, tool results from
`functions.NAME to=assistant` on commentary. Not supported: the built-in `browser` / `python` tools (nothing
here runs them; a reply's messages to them are dropped, as llama.cpp drops them).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import date
from typing import Any, Callable

from edgeserve.errors import ChatTemplateError
from edgeserve.text.tool_calls import ToolCall, function_parameters

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
RETURN, CALL = "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)

DEFAULT_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
EFFORTS = ("low", "medium", "high")
DEFAULT_EFFORT = "medium"


def template_is_harmony(template_source: str) -> bool:
    """Whether a chat template writes harmony (gpt-oss) messages."""
    return all(m in template_source for m in (START, MESSAGE, CHANNEL))


def reasoning_effort(value: Any) -> str | None:
    """A request's reasoning level as harmony's `Reasoning:` value, or None for the default (medium).

    Accepts OpenAI / Responses efforts ("none" and "minimal" are harmony's lowest, "low"; "xhigh" and "max" its
    highest, "high"), Ollama's `think` (false: "low", true: the default, or a level), and Anthropic thinking
    budgets in tokens (< 4096: "low", < 16384: "medium", else "high")."""
    if value is None or value is True:
        return None
    if value is False:
        return "low"
    if isinstance(value, int):
        return "low" if value < 4096 else "medium" if value < 16384 else "high"
    if isinstance(value, str):
        v = value.lower()
        if v in EFFORTS:
            return v
        if v in ("none", "minimal"):
            return "low"
        if v in ("xhigh", "max"):
            return "high"
    return None


# --- tools as TypeScript ---------------------------------------------------------------------------------------


def _default_comment(schema: dict) -> str:
    """`default: X` as the reference renderer writes it (a string default is quoted unless the schema is an enum)."""
    value = schema["default"]
    if isinstance(value, str):
        return f"default: {value}" if schema.get("enum") else f'default: "{value}"'
    return "default: " + json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def typescript_type(schema: Any, indent: str = "") -> str:
    """A JSON schema as the TypeScript-like type harmony shows the model (openai/harmony's rendering rules)."""
    if not isinstance(schema, dict):
        return "any"
    if isinstance(schema.get("oneOf"), list):
        parts = []
        for variant in schema["oneOf"]:
            text = _nullable(variant, typescript_type(variant, indent + "   "))
            notes = [variant["description"]] if isinstance(variant, dict) and variant.get("description") else []
            if isinstance(variant, dict) and "default" in variant:
                notes.append(_default_comment(variant))
            parts.append(f"\n{indent} | {text}" + (f" // {' '.join(notes)}" if notes else ""))
        return "".join(parts)
    kind = schema.get("type")
    if isinstance(kind, list) and kind:
        return " | ".join("number" if k == "integer" else str(k) for k in kind)
    if kind == "object":
        return _object_type(schema, indent)
    if kind == "string":
        enum = [v for v in schema.get("enum") or [] if isinstance(v, str)]
        return " | ".join(f'"{v}"' for v in enum) if enum else "string"
    if kind in ("number", "integer"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "array":
        return f"{typescript_type(schema['items'], indent)}[]" if "items" in schema else "Array<any>"
    return "any"


def _nullable(schema: Any, text: str) -> str:
    if isinstance(schema, dict) and schema.get("nullable") is True and "null" not in text:
        return text + " | null"
    return text


def _object_type(schema: dict, indent: str) -> str:
    out = f"{indent}// {schema['description']}\n" if schema.get("description") else ""
    out += "{\n"
    required = set(schema.get("required") or [])
    for key, prop in (schema.get("properties") or {}).items():
        prop = prop if isinstance(prop, dict) else {}
        optional = "" if key in required else "?"
        if prop.get("title"):
            out += f"{indent}// {prop['title']}\n{indent}//\n"
        one_of = prop.get("oneOf") if isinstance(prop.get("oneOf"), list) else None
        if prop.get("description") and one_of is None:
            out += f"{indent}// {prop['description']}\n"
        examples = [e for e in prop.get("examples") or [] if isinstance(e, str)]
        if examples:
            out += f"{indent}// Examples:\n" + "".join(f'{indent}// - "{e}"\n' for e in examples)
        if one_of is not None:
            out += _one_of_property(key + optional, prop, one_of, indent)
            continue
        out += f"{indent}{key}{optional}: {_nullable(prop, typescript_type(prop, indent + '    '))},"
        if "default" in prop:
            out += f" // {_default_comment(prop)}"
        out += "\n"
    return out + f"{indent}}}"


def _one_of_property(name: str, prop: dict, variants: list, indent: str) -> str:
    """A property whose schema is a oneOf: one `| type // notes` line per variant."""
    desc = prop.get("description")
    first_desc = variants[0].get("description") if variants and isinstance(variants[0], dict) else None
    above = bool(desc) and desc != first_desc
    out = f"{indent}// {desc}\n" if above else ""
    if "default" in prop:
        out += f"{indent}// {_default_comment(prop)}\n"
    out += f"{indent}{name}:\n"
    for i, variant in enumerate(variants):
        variant = variant if isinstance(variant, dict) else {}
        notes = []
        if not (i == 0 and above) and variant.get("description") and variant["description"] != desc:
            notes.append(variant["description"])
        if "default" in variant:
            notes.append(_default_comment(variant))
        out += f"{indent} | {_nullable(variant, typescript_type(variant, indent + '   '))}"
        out += (f" // {' '.join(notes)}" if notes else "") + "\n"
    return out + f"{indent},\n"


def tools_namespace(tools: list[dict]) -> str:
    """The `## functions` section listing OpenAI-shaped function tools as `namespace functions { ... }`."""
    lines = ["## functions\n", "namespace functions {\n"]
    for tool in tools:
        fn = tool["function"]
        lines += [f"// {line}" for line in (fn.get("description") or "").splitlines()]
        params = fn.get("parameters")
        if isinstance(params, dict) and params.get("properties"):
            lines.append(f"type {fn['name']} = (_: {typescript_type(params)}) => any;\n")
        else:
            lines.append(f"type {fn['name']} = () => any;\n")
    lines.append("} // namespace functions")
    return "\n".join(lines)


# --- prompts ---------------------------------------------------------------------------------------------------


@dataclass
class HarmonyOptions:
    """The system message's variables: `reasoning_effort` low / medium / high, the identity line, the date (None:
    today's)."""

    reasoning_effort: str = DEFAULT_EFFORT
    model_identity: str = DEFAULT_IDENTITY
    current_date: str | None = None


def harmony_options(template_kwargs: dict[str, Any], think: bool | None = None) -> HarmonyOptions:
    """The options a request's template variables ask for: `reasoning_effort` (any value `reasoning_effort()`
    maps; else `think`, else `enable_thinking`) and `model_identity`."""
    level = template_kwargs.get("reasoning_effort", think if think is not None
                                else template_kwargs.get("enable_thinking"))
    options = HarmonyOptions(reasoning_effort(level) or DEFAULT_EFFORT)
    if isinstance(template_kwargs.get("model_identity"), str):
        options.model_identity = template_kwargs["model_identity"]
    return options


def _message(header: str, content: str, end: str = END) -> str:
    return f"{START}{header}{MESSAGE}{content}{end}"


def _system_message(options: HarmonyOptions, has_tools: bool) -> str:
    today = options.current_date or date.today().isoformat()
    text = (f"{options.model_identity}\nKnowledge cutoff: {KNOWLEDGE_CUTOFF}\nCurrent date: {today}\n\n"
            f"Reasoning: {options.reasoning_effort}\n\n"
            "# Valid channels: analysis, commentary, final. Channel must be included for every message.")
    if has_tools:
        text += "\nCalls to these tools must go to the commentary channel: 'functions'."
    return _message("system", text)


def _arguments_json(args: Any) -> str:
    """A call's arguments as the JSON text the template writes (`tojson` of the object)."""
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return args
    return json.dumps(args, ensure_ascii=False)


def render_harmony(messages: list[dict[str, Any]], tools: list[dict] | None = None,
                   options: HarmonyOptions | None = None, add_generation_prompt: bool = True) -> str:
    """The harmony prompt of a chat conversation (edgeserve's message dicts: role, content, tool_calls,
    tool_call_id / tool_name / name, reasoning_content), ending with `<|start|>assistant` when
    `add_generation_prompt`. A conversation harmony cannot express is a ChatTemplateError."""
    options = options or HarmonyOptions()
    out = [_system_message(options, bool(tools))]
    rest = list(messages)
    instructions = rest.pop(0)["content"] if rest and rest[0]["role"] in ("system", "developer") else ""
    if instructions or tools:
        sections = [f"# Instructions\n\n{instructions}"] if instructions else []
        if tools:
            sections.append("# Tools\n\n" + tools_namespace(tools))
        out.append(_message("developer", "\n\n".join(sections)))
    call_names: dict[str, str] = {}  # tool_call_id -> function name, to name each tool result
    last_call: str | None = None
    for i, m in enumerate(rest):
        role, content = m["role"], m.get("content") or ""
        if role in ("system", "developer"):  # later instructions stay developer instructions
            out.append(_message("developer", f"# Instructions\n\n{content}"))
        elif role == "user":
            out.append(_message("user", content))
        elif role == "assistant" and m.get("tool_calls"):
            # the reasoning that led to a call is kept until a final answer follows it (harmony's rule)
            answered = any(n["role"] == "assistant" and not n.get("tool_calls") for n in rest[i + 1:])
            thought = m.get("reasoning_content") or ""
            if not answered:
                if thought:
                    out.append(_message("assistant<|channel|>analysis", thought))
                if content:  # the official template's place for content beside calls
                    out.append(_message("assistant<|channel|>" + ("commentary" if thought else "analysis"),
                                        content))
            for call in m["tool_calls"]:
                fn = call["function"]
                last_call = fn["name"]
                if call.get("id"):
                    call_names[call["id"]] = last_call
                out.append(_message(f"assistant to=functions.{last_call}{CHANNEL}commentary json",
                                    _arguments_json(fn.get("arguments", {})), CALL))
        elif role == "assistant":
            out.append(_message("assistant<|channel|>final", content))
            last_call = None
        elif role == "tool":
            name = m.get("tool_name") or m.get("name") or call_names.get(m.get("tool_call_id", "")) or last_call
            if name is None:
                raise ChatTemplateError("a tool message must follow an assistant message with tool_calls")
            out.append(_message(f"functions.{name} to=assistant{CHANNEL}commentary", content))
        else:
            raise ChatTemplateError(f"harmony has no role {role!r}")
    if add_generation_prompt:
        out.append(START + "assistant")
    return "".join(out)


# --- replies ---------------------------------------------------------------------------------------------------

_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_BODY_ENDS = (END, RETURN, CALL, START, CHANNEL)
_TO_THE_READER = ("all", "assistant", "user")  # recipients that make a message an ordinary one
_MAX_HEADER = 512  # header text without <|message|> past this is not harmony: it is shown as content


def _held_marker(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of one of `markers`."""
    for k in range(min(max(map(len, markers)) - 1, len(buf)), 0, -1):
        if any(m.startswith(buf[-k:]) for m in markers):
            return k
    return 0


def render_continued_harmony(messages: list[dict[str, Any]], tools: list[dict] | None, options: HarmonyOptions,
                             reasoning: bool) -> str:
    """The harmony prompt of a conversation whose final assistant message the reply continues (assistant prefill):
    it ends inside that message's analysis (`reasoning`) or, after its analysis if it has one, its final message."""
    last = messages[-1]
    out = render_harmony(messages[:-1], tools, options) + CHANNEL + "analysis" + MESSAGE
    thought = last.get("reasoning_content") or ""
    if reasoning:
        return out + thought
    if not thought:
        out = out[:-len(CHANNEL + "analysis" + MESSAGE)]
    else:
        out += thought + END + START + "assistant"
    return out + CHANNEL + "final" + MESSAGE + (last.get("content") or "")


@dataclass
class HarmonyParser:
    """Splits one harmony reply as it streams: push(text) -> (reasoning, content); finish() -> (reasoning,
    content, tool calls). Same interface as edgeserve.text.chat_output.ChatOutputParser.

    analysis -> reasoning; final and commentary without a recipient (a preamble) -> content; a header naming
    its channel twice (`commentary to=assistant<|channel|>final`) goes by the last; a message to
    `functions.NAME` (NAME in `known`) -> a tool call, returned at finish() (a call ends the turn: `<|call|>`);
    a call to an unknown function is content; messages to other recipients (built-in tools: `python`,
    `browser.search`, `container.exec`) are dropped. No harmony marker ever reaches reasoning or content; nothing
    returned is retracted. `raw_reasoning` (reasoning_format "none"): an analysis message is content as written,
    from its `<|channel|>` to its `<|end|>`, as llama.cpp returns it."""

    known: set[str] = field(default_factory=set)
    parallel: bool = True
    raw_reasoning: bool = False
    _state: str = "header"  # the prompt ended with <|start|>assistant: the reply opens with the rest of a header
    _buf: str = ""
    _kind: str = ""  # of the message being read: "reasoning", "content", "call" or "unknown_call"
    _call: str = ""
    _args: str = ""
    _calls: list[ToolCall] = field(default_factory=list)
    _opened: bool = False  # a harmony message header was read

    def continuing(self, reasoning: bool) -> HarmonyParser:
        """This parser reading a reply that continues a prefilled message (render_continued_harmony): it starts
        inside the analysis message (`reasoning`) or the final one."""
        self._state, self._kind, self._opened = "body", "reasoning" if reasoning else "content", True
        return self

    def push(self, text: str) -> tuple[str, str]:
        """Add reply text; return (new reasoning, new content)."""
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        """At the end of the reply: what is still held, and the tool calls."""
        pieces = dict(zip(("reasoning", "content"), self._drain(final=True)))
        if self._state == "body":
            self._end_message(pieces)
        calls = self._calls if self.parallel else self._calls[:1]
        return pieces["reasoning"], pieces["content"], calls

    def _drain(self, final: bool) -> tuple[str, str]:
        pieces = {"reasoning": "", "content": ""}
        while self._buf and self._state != "done":
            if self._state == "between":  # after <|end|>: the next message's <|start|>
                at = self._buf.find(START)
                if at < 0:
                    keep = _held_marker(self._buf, (START,))
                    self._buf = self._buf[len(self._buf) - keep:] if keep and not final else ""
                    break
                self._state, self._buf = "header", self._buf[at + len(START):]
            elif self._state == "header":
                at = self._buf.find(MESSAGE)
                if at < 0:
                    if len(self._buf) > _MAX_HEADER or (final and not self._opened and "<|" not in self._buf):
                        # not a harmony header (a model that ignores the format): plain content
                        self._kind, self._state = "content", "body"
                        continue
                    if final:
                        self._buf = ""
                    break
                self._open(self._buf[:at], pieces)
                self._buf = self._buf[at + len(MESSAGE):]
            else:  # body
                ends = [(i, m) for m in _BODY_ENDS if (i := self._buf.find(m)) >= 0]
                if ends:
                    at, marker = min(ends)
                    self._emit(self._buf[:at], pieces)
                    if self._kind == "raw_thought" and marker == END:
                        pieces["content"] += END
                    self._end_message(pieces)
                    self._buf = self._buf[at + len(marker):]
                    if marker == START:
                        self._state = "header"
                    elif marker == CHANNEL:
                        self._state, self._buf = "header", CHANNEL + self._buf
                    else:
                        self._state = "between" if marker == END else "done"
                    continue
                keep = 0 if final else _held_marker(self._buf, MARKERS)
                self._emit(self._buf[:len(self._buf) - keep], pieces)
                self._buf = self._buf[len(self._buf) - keep:]
                break
        if self._state == "done":
            self._buf = ""
        return pieces["reasoning"], pieces["content"]

    def _open(self, header: str, pieces: dict[str, str]) -> None:
        """Start a message: its header says where its content goes."""
        recipient = m.group(1) if (m := _RECIPIENT.search(header)) else ""
        # a header may name its channel twice (`commentary to=assistant<|channel|>final`): the last one counts
        channels = _CHANNEL_NAME.findall(header)
        channel = channels[-1] if channels else ""
        if recipient.startswith("functions."):
            self._call, self._args = recipient[len("functions."):], ""
            self._kind = "call" if self._call in self.known else "unknown_call"
        elif recipient and recipient not in _TO_THE_READER:
            # a call to a built-in tool (python, browser.search, container.exec): nothing here runs them, and it
            # is neither the answer nor the thought (llama.cpp drops it the same way)
            self._kind = "dropped"
        else:
            self._kind = "reasoning" if channel == "analysis" else "content"
        if self._kind == "reasoning" and self.raw_reasoning:  # the thought stays in the content as written
            self._kind = "raw_thought"
            pieces["content"] += header[max(header.find(CHANNEL), 0):] + MESSAGE
        self._state, self._opened = "body", True

    def _emit(self, text: str, pieces: dict[str, str]) -> None:
        text = text.replace(MESSAGE, "").replace(CONSTRAIN, "")  # stray header markers in a body: never shown
        if not text:
            return
        if self._kind in ("call", "unknown_call"):
            self._args += text
        elif self._kind == "raw_thought":
            pieces["content"] += text
        elif self._kind != "dropped":
            pieces[self._kind] += text

    def _end_message(self, pieces: dict[str, str]) -> None:
        if self._kind == "call":
            self._calls.append(ToolCall(self._call, self._args.strip()))
        elif self._kind == "unknown_call":  # as the other formats do: a call to no known function is text
            pieces["content"] += self._args
        self._kind = ""


# --- grammars --------------------------------------------------------------------------------------------------

# The analysis messages a constrained reply may write before its constrained message (llguidance's Lark dialect,
# special tokens written as themselves): the thought is any text, which cannot contain a special token, so it
# ends at <|end|>.
_ANALYSIS = (f'analysis: {CHANNEL} "analysis" {MESSAGE} THOUGHT {END} {START} "assistant"\n'
             "THOUGHT: /(?s:.*)/\n")


def answer_frame() -> str:
    """Lark rules for a harmony reply whose final answer is the grammar's `answer_start` rule."""
    return (f'start: analysis* {CHANNEL} "final" (" " {CONSTRAIN} "json")? {MESSAGE} answer_start\n'
            + _ANALYSIS)


def tool_call_grammar(tools: list[dict], choice: str | None, json_rule: Callable[[Any], str]) -> str:
    """The whole Lark grammar of a harmony reply that must call `choice` (or any of `tools` when None): analysis
    messages, then one call on commentary whose arguments match the function's parameters schema (`json_rule`:
    edgeserve.text.grammar.json_rule). One call: a harmony turn ends at its first call."""
    chosen = [t for t in tools if choice is None or t["function"]["name"] == choice]
    rules = []
    for i, tool in enumerate(chosen):
        rules.append(f"call_{i}: {json.dumps(tool['function']['name'])} (\" \" {CONSTRAIN}? \"json\")? {MESSAGE} "
                     f"args_{i}\nargs_{i}: {json_rule(function_parameters(tool))}\n")
    calls = " | ".join(f"call_{i}" for i in range(len(chosen)))
    return (f'start: analysis* {CHANNEL} "commentary to=functions." ({calls})\n' + "".join(rules) + _ANALYSIS)
