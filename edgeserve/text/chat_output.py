"""One chat reply's text split into reasoning, content and tool calls, as it streams.

`ChatOutputParser.push(text)` returns the reasoning and content that are final; text that may belong to a tool
call is held back (from the format's start marker on) and parsed at `finish()`, which returns the calls. Nothing
returned is ever retracted, so streamed deltas and the non-streamed message are the same text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edgeserve.text.reasoning import ReasoningSplitter
from edgeserve.text.tool_calls import NATIVE_FORCED, ToolCall, parse_forced, parse_tool_calls, start_markers


@dataclass
class ToolSetup:
    """How a reply's tool calls are read. mode: "auto" (parse the template's format out of free text) or "forced"
    (the reply is `forced_schema` JSON, or calls in the format itself for one in NATIVE_FORCED: `choice` names the
    function, None for "required"). `schemas`: each function's parameters schema, for formats that type values
    by it."""

    mode: str
    fmt: str = "hermes"
    known: set[str] = field(default_factory=set)
    choice: str | None = None
    parallel: bool = True
    schemas: dict[str, dict] = field(default_factory=dict)


def _partial(buf: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:k]):
            return k
    return 0


class ChatOutputParser:
    """Splits one reply: push() text pieces, then finish() once."""

    def __init__(self, reasoning: ReasoningSplitter | None, tools: ToolSetup | None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self._held = ""  # content that may be (the start of) a tool call
        self._in_call = False
        self._content = ""  # all content returned so far

    def push(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text` completes."""
        thought, content = self.reasoning.push(text) if self.reasoning is not None else ("", text)
        return thought, self._content_piece(content)

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        """(reasoning, content, tool calls) left at the end of the reply."""
        thought, content = self.reasoning.flush() if self.reasoning is not None else ("", "")
        content = self._content_piece(content)
        held, self._held = self._held, ""
        calls: list[ToolCall] = []
        if self.tools is not None and held:
            if self.tools.mode == "forced" and self.tools.fmt not in NATIVE_FORCED:
                calls = parse_forced(held, self.tools.choice)
                rest = "" if calls else held
            else:
                rest, calls = parse_tool_calls(held, self.tools.fmt, self.tools.known, self.tools.schemas)
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
        starts = [i for m in start_markers(self.tools.fmt) if (i := buf.find(m)) >= 0]
        if starts:
            at = min(starts)
            self._in_call, self._held = True, buf[at:]
            out = buf[:at]
        else:
            hold = max(_partial(buf, m) for m in start_markers(self.tools.fmt))
            self._held, out = buf[len(buf) - hold:], buf[: len(buf) - hold]
        self._content += out
        return out
