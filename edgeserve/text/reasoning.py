"""Reasoning split from the answer: `<think>...</think>` text streamed into its own field.

Models that think (Qwen3, DeepSeek-R1 distills, QwQ) write their reasoning between `<think>` and `</think>` before
the answer. Whether a model does is read from its chat template (it mentions `<think>`); whether this reply starts
inside the reasoning is read from the rendered prompt (DeepSeek-R1's template opens `<think>` itself; Qwen3 with
`enable_thinking: false` closes an empty one). Gemma 4 writes its reasoning in a thought channel instead,
`<|channel>thought\n...<channel|>` (its template turns it on with `enable_thinking`); `reasoning_tags` says which
pair a template's model uses.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
GEMMA4_THOUGHT = ("<|channel>thought\n", "<channel|>")
GEMMA4_TURN = "<|turn>"  # Gemma 4's turn marker: its templates have it, others do not


def reasoning_tags(template_source: str) -> tuple[str, str] | None:
    """The (open, close) tags the reasoning of a chat template's model sits between; None for one that does not
    reason."""
    if GEMMA4_TURN in template_source:
        return GEMMA4_THOUGHT
    if THINK_OPEN in template_source or THINK_CLOSE in template_source:
        return THINK_OPEN, THINK_CLOSE
    return None


def template_thinks(template_source: str) -> bool:
    """Whether a chat template belongs to a model that reasons (<think> tags, Gemma 4's thought channel)."""
    return reasoning_tags(template_source) is not None


def prompt_opens_thought(prompt: str, open_tag: str = THINK_OPEN) -> bool:
    """Whether the rendered prompt ends inside an open reasoning tag (the reply starts with reasoning)."""
    return prompt.rstrip().endswith(open_tag.strip())


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
    itself, when the prompt opened it) and the first closing one; whitespace right after </think> is dropped; everything else is
    content. Nothing returned is ever retracted.
    """

    in_thought: bool = False  # the prompt opened the reasoning
    open_tag: str = THINK_OPEN
    close_tag: str = THINK_CLOSE
    _state: str = "start"  # start -> (thought ->) answer
    _held: str = ""

    def __post_init__(self) -> None:
        if self.in_thought:
            self._state = "thought"

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
            elif self._state == "thought":
                end = buf.find(self.close_tag)
                if end >= 0:
                    reasoning += buf[:end]
                    self._state, buf = "after", buf[end + len(self.close_tag):]
                else:
                    hold = _partial(buf, self.close_tag)
                    reasoning += buf[: len(buf) - hold]
                    self._held = buf[len(buf) - hold:]
                    return reasoning, content
            elif self._state == "after":  # drop the whitespace between the reasoning and the answer
                buf = buf.lstrip()
                if buf:
                    self._state = "answer"
            else:
                content += buf
                buf = ""
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """At the end of the reply: whatever is held (an unfinished tag is text of the field it was in)."""
        held, self._held = self._held, ""
        if self._state == "thought":
            return held, ""
        return "", held
