"""Reasoning split from the answer: `<think>...</think>` (or a format's own tags) streamed into its own field.

Models that think (Qwen3, DeepSeek-R1 distills, QwQ) write their reasoning between `<think>` and `</think>` before
the answer. A format in the registry (edgeserve.text.formats) may name other tags (`ChatFormat.reasoning`: Gemma 4's
thought channel `<|channel>thought...<channel|>`); otherwise a template that mentions `<think>` reasons with those.
Whether this reply starts inside the reasoning is read from the rendered prompt (DeepSeek-R1's template opens
`<think>` itself; Qwen3 with `enable_thinking: false` closes an empty one).

Reasoning comes back trimmed (no whitespace at its start or end), as llama.cpp returns it.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def reasoning_tags(template_source: str) -> tuple[str, str] | None:
    """The (open, close) tags the reasoning of a chat template's model sits between (its format's, else <think>
    when the template mentions it); None for one that does not reason."""
    from edgeserve.text.formats import detect_format

    return format_reasoning_tags(detect_format(template_source).reasoning, template_source)


def format_reasoning_tags(tags: tuple[str, str] | None, template_source: str) -> tuple[str, str] | None:
    """A format's reasoning tags, else the generic rule: <think> / </think> when the template mentions either."""
    if tags is not None:
        return tags
    if THINK_OPEN in template_source or THINK_CLOSE in template_source:
        return THINK_OPEN, THINK_CLOSE
    return None


def template_thinks(template_source: str) -> bool:
    """Whether a chat template belongs to a model that reasons (<think> tags, or its format's own)."""
    return reasoning_tags(template_source) is not None


def prompt_opens_thought(prompt: str, open_tag: str = THINK_OPEN, close_tag: str = THINK_CLOSE) -> bool:
    """Whether the rendered prompt ends inside an open thought (the reply starts with reasoning): its last open tag
    comes after its last close tag (right at its end, or followed by prefilled reasoning the reply continues)."""
    opened = prompt.rfind(open_tag.strip())
    return opened >= 0 and opened > prompt.rfind(close_tag.strip())


def _partial(buf: str, tag: str) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:k]):
            return k
    return 0


@dataclass
class ReasoningSplitter:
    """Feed reply text as it streams; get (reasoning, content) pieces. A tag split across pieces is held back.

    Reasoning is the text between an opening tag (<think>, or `open_tag`) at the start of the reply (or the start
    itself, when the prompt opened it) and the first closing one, or the first of `ends` (text that ends a thought
    without closing it and belongs to the answer: a format's call markers, for models that call tools from inside
    an open thought); whitespace at the reasoning's ends and right after the closing tag is dropped; everything
    else is content (`trim` false: no whitespace dropped). With `keep_open` the open tag itself is the reasoning's
    first text. Nothing returned is ever
    retracted.
    """

    in_thought: bool = False  # the prompt opened the reasoning
    open_tag: str = THINK_OPEN
    close_tag: str = THINK_CLOSE
    ends: tuple[str, ...] = ()
    keep_open: bool = False  # the open tag is prose the reasoning starts with (Apriel 1.6): it is returned first
    trim: bool = True  # False: the thought's whitespace is kept as written (its text goes into the content)
    _state: str = "start"  # start -> (thought ->) answer
    _held: str = ""  # the start of a tag, maybe
    _space: str = ""  # whitespace at the end of the reasoning so far: shown only when more reasoning follows
    _started: bool = False  # some reasoning text was returned
    _echo: bool = False  # the prompt opened the thought and the model may write the open tag again (MiniMax M3)
    continued: bool = False  # the reply continues prefilled reasoning: its leading whitespace is kept

    def __post_init__(self) -> None:
        if self.in_thought:
            self._state, self._echo = "thought", not self.continued
            self._started = self.continued

    def push(self, text: str) -> tuple[str, str]:
        """Add reply text; return (new reasoning, new content)."""
        buf = self._held + text
        self._held = ""
        reasoning = content = ""
        while buf:
            if self._state == "start":
                stripped = buf.lstrip()
                if stripped.startswith(self.open_tag):
                    self._state, buf = "thought", stripped[len(self.open_tag):]
                elif self.open_tag.startswith(stripped):  # may still become <think>
                    self._held = buf
                    return reasoning, content
                else:
                    self._state = "answer"
            elif self._state == "thought" and self._echo:  # an open tag written again is not reasoning
                stripped = buf.lstrip()
                if not stripped or (self.open_tag.startswith(stripped) and stripped != self.open_tag):
                    self._held = buf
                    return reasoning, content
                self._echo = False
                if stripped.startswith(self.open_tag):
                    buf = stripped[len(self.open_tag):]
            elif self._state == "thought":
                piece, buf = self._thought(buf)
                reasoning += piece
            elif self._state == "after":  # drop the whitespace between the reasoning and the answer
                buf = buf.lstrip() if self.trim else buf
                if buf:
                    self._state = "answer"
            else:
                content += buf
                buf = ""
        return reasoning, content

    def _thought(self, buf: str) -> tuple[str, str]:
        """(reasoning, text left) of text inside the thought: up to its end (the state moves on), or all of it but
        the start of a tag (held)."""
        ends = [(at, self.close_tag) for at in [buf.find(self.close_tag)] if at >= 0]
        ends += [(at, e) for e in self.ends if (at := buf.find(e)) >= 0]
        if ends:
            at, tag = min(ends, key=lambda x: x[0])
            if tag == self.close_tag:
                self._state, rest = "after", buf[at + len(tag):]
            else:  # a call: it belongs to the answer
                self._state, rest = "answer", buf[at:]
            return self._trimmed(buf[:at], final=True), rest
        hold = max(_partial(buf, t) for t in (self.close_tag, *self.ends))
        self._held = buf[len(buf) - hold:]
        return self._trimmed(buf[: len(buf) - hold], final=False), ""

    def _trimmed(self, text: str, final: bool) -> str:
        """Reasoning text without the whitespace at the reasoning's start, and with trailing whitespace held until
        more reasoning follows (dropped when the reasoning ends: `final`); as written when not `trim`."""
        if not self.trim:
            return text
        text = self._space + text
        if not self._started:
            text = (self.open_tag if self.keep_open else "") + text.lstrip()
            self._started = bool(text)
        body = text.rstrip()
        self._space = "" if final else text[len(body):]
        return body

    def flush(self) -> tuple[str, str]:
        """At the end of the reply: whatever is held (an unfinished tag is text of the field it was in)."""
        held, self._held = self._held, ""
        if self._state == "thought":
            return self._trimmed(held, final=True), ""
        return "", held
