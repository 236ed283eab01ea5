"""One chat reply's text split into reasoning, content and tool calls, as it streams.

`ChatOutputParser.push(text)` returns the reasoning and content that are final; text that may belong to a tool
call is held back (from the format's first call marker on) and parsed at `finish()`, which returns the calls.
Nothing returned is ever retracted, so streamed deltas and the non-streamed message are the same text. A call the
format's parser cannot read (unclosed, arguments that are not JSON, a function that was not offered) comes back as
content: the parser never raises and never drops text.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

from edgeserve.text.formats import CallContext, ChatFormat, get_format
from edgeserve.text.formats.base import ToolCall
from edgeserve.text.reasoning import ReasoningSplitter
from edgeserve.text.tool_calls import parse_forced

log = logging.getLogger("edgeserve.server")


@dataclass
class ToolSetup:
    """How a reply's tool calls are read. mode: "auto" (parse the format's calls out of free text) or "forced"
    (the reply is the format's own forced calls when it has a grammar for them, `ChatFormat.forced`, else
    `forced_schema` JSON: `choice` names the function, None for "required"). `fmt`: the format (or its registered
    name). `schemas`: each function's parameters schema, for formats that type values by it."""

    mode: str
    fmt: ChatFormat | str = "hermes"
    known: set[str] = field(default_factory=set)
    choice: str | None = None
    parallel: bool = True
    schemas: dict[str, dict] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.fmt, str):
            self.fmt = get_format(self.fmt)

    @property
    def format(self) -> ChatFormat:
        """The format, as a ChatFormat."""
        assert isinstance(self.fmt, ChatFormat)
        return self.fmt

    def read(self, held: str, cut: bool = False) -> tuple[str, list[ToolCall]]:
        """(content, calls) of the held text (from the first call marker on). A parser that fails leaves it all
        as content. `cut`: the reply was cut short (finish "length"): a call it cut is read by the format's
        `cut` reader when the parser reads none."""
        rest, calls = self._parse(held)
        if cut and not calls and self.mode == "auto" and self.format.cut is not None:
            cut_calls = self.format.cut(held, CallContext(set(self.known), dict(self.schemas)))
            if cut_calls:
                return "", cut_calls
        return rest, calls

    def _parse(self, held: str) -> tuple[str, list[ToolCall]]:
        fmt = self.format
        if self.mode == "forced" and fmt.forced is None:
            calls = parse_forced(held, self.choice)
            if calls:
                return "", calls
            # not the generic JSON (no constraint applied): calls in the format's own syntax are still calls
        if fmt.parse is None:
            return held, []
        try:
            rest, calls = fmt.parse(held, CallContext(set(self.known), dict(self.schemas)))
        except Exception:  # a format's parser must never turn a reply into a 500
            log.exception("the %s call parser failed; the reply is returned as content", fmt.name)
            return held, []
        return rest, calls


def _partial(buf: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:k]):
            return k
    return 0


class StrayFilter:
    """Removes a format's stray markers (`ChatFormat.stray`) from streamed text, longer ones first; the start of
    one at the end of a piece is held until the next."""

    def __init__(self, markers: tuple[str, ...]) -> None:
        self.markers = tuple(sorted(markers, key=len, reverse=True))
        self._pattern = re.compile("|".join(map(re.escape, self.markers))) if markers else None
        self._held = ""

    def push(self, text: str) -> str:
        """The text without markers, less what may be the start of one."""
        if self._pattern is None:
            return text
        buf = self._held + text
        hold = max(_partial(buf, m) for m in self.markers)
        self._held = buf[len(buf) - hold:]
        return self._pattern.sub("", buf[: len(buf) - hold])

    def flush(self) -> str:
        """What is held at the end (the start of a marker that never came is text)."""
        held, self._held = self._held, ""
        return self._pattern.sub("", held) if self._pattern is not None else held


class ChatOutputParser:
    """Splits one reply: push() text pieces, then finish() once. `stray`: markers removed from the content;
    `prefix`: content shown before the reply's own (the thought the prompt opened, when reasoning stays raw);
    `thought_as_content`: the reasoning's text, its tags taken off, is content (reasoning_format "none" for a
    format with `raw_thought_untagged`)."""

    def __init__(self, reasoning: ReasoningSplitter | None, tools: ToolSetup | None,
                 stray: tuple[str, ...] = (), prefix: str = "", thought_as_content: bool = False) -> None:
        self.reasoning = reasoning
        self._thought_as_content = thought_as_content
        self.tools = tools
        self._stray = StrayFilter(stray)
        self._prefix = prefix
        self._held = ""  # content that may be (the start of) a tool call
        self._in_call = False
        self._content = ""  # all content returned so far

    def push(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text` completes."""
        thought, content = self._split(*(self.reasoning.push(text) if self.reasoning is not None else ("", text)))
        content, self._prefix = self._prefix + content, ""
        return thought, self._content_piece(self._stray.push(content))

    def _split(self, thought: str, content: str) -> tuple[str, str]:
        """(reasoning, content) as returned: the thought moved into the content under `thought_as_content`."""
        return ("", thought + content) if self._thought_as_content else (thought, content)

    def finish(self, cut: bool = False) -> tuple[str, str, list[ToolCall]]:
        """(reasoning, content, tool calls) left at the end of the reply; `cut`: it was cut short (max_tokens)."""
        thought, content = self._split(*(self.reasoning.flush() if self.reasoning is not None else ("", "")))
        content, self._prefix = self._prefix + content, ""
        content = self._content_piece(self._stray.push(content) + self._stray.flush())
        held, self._held = self._held, ""
        calls: list[ToolCall] = []
        if self.tools is not None and held:
            rest, calls = self.tools.read(held, cut)
            if not self.tools.parallel:
                calls = calls[:1]
            content += rest
        else:
            content += held
        self._content += content
        return thought, content, calls

    def _content_piece(self, text: str) -> str:
        if self.tools is None or not text:
            self._content += text
            return text
        if self._in_call or self.tools.mode == "forced":
            self._held += text
            return ""
        buf = self._held + text
        markers = self.tools.format.call_markers
        starts = [i for m in markers if (i := buf.find(m)) >= 0]
        if starts:
            at = min(starts)
            self._in_call, self._held = True, buf[at:]
            out = buf[:at]
        else:
            hold = max((_partial(buf, m) for m in markers), default=0)
            self._held, out = buf[len(buf) - hold:], buf[: len(buf) - hold]
        self._content += out
        return out
