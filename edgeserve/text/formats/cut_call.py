"""A reply cut short (finish "length") inside a tool call, read as llama.cpp returns it: the call whose name is
complete, with its arguments as far as they got.

A format opts in with `ChatFormat.cut`, usually `tail_cut(pattern)`: a regular expression that matches the whole
held text (from the first call marker on) when it is one call cut short, with groups `name`, optionally `args`
(the arguments written so far) and `id`. A cut call after complete ones in the same block is not read (the text
stays content, as for any call the parser cannot read).
"""

from __future__ import annotations

import re
from typing import Callable

from edgeserve.text.formats.base import CallContext, ToolCall

CutReader = Callable[[str, CallContext], "list[ToolCall]"]


def tail_cut(pattern: str, arguments: Callable[[str], str] = lambda text: text) -> CutReader:
    """A cut reader for held text that `pattern` matches whole (re.DOTALL); `arguments` turns the arguments
    written so far into (partial) JSON text. A function that was not offered is no call."""
    rx = re.compile(pattern, re.DOTALL)

    def read(text: str, ctx: CallContext) -> list[ToolCall]:
        m = rx.fullmatch(text.lstrip())
        if m is None or (ctx.known and m.group("name") not in ctx.known):
            return []
        groups = m.groupdict()
        return [ToolCall(m.group("name"), arguments(groups.get("args") or ""), groups.get("id") or "")]

    return read


def pythonic_arguments(text: str) -> str:
    """Python keyword arguments written so far (`a=1, b=`) as the start of their JSON object (`{"a": 1, "b": `);
    values stay as written."""
    return "{" + re.sub(r"(^|,\s*)([A-Za-z_]\w*)\s*=\s*", r'\1"\2": ', text.strip())
