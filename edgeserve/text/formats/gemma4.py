"""Gemma 4: calls `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:5}<tool_call|>`, one per call (arguments an object
with bare keys and strings between `<|"|>` delimiters); reasoning in a thought channel,
`<|channel>thought\\n...<channel|>` (the newline is missing when the thought is empty).

After a call the template expects `<|tool_response>`: the reply stops there (llama.cpp makes the token end the
turn), so the model never writes a tool's answer itself. Stray channel markers (`<channel|>`, an empty second
thought at the end) never reach the content.
"""

from __future__ import annotations

import json
import re

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall

CALL_OPEN, CALL_CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
THOUGHT = ("<|channel>thought", "<channel|>")
TURN = "<|turn>"  # Gemma 4's turn marker: its templates have it, others do not
TOOL_RESPONSE = "<|tool_response>"

_CALL = re.compile(re.escape(CALL_OPEN) + r"call:([\w.\-]+)(.*?)(?:" + re.escape(CALL_CLOSE) + r"|$)", re.S)
_BARE_KEY = re.compile(r"([{,]\s*)([A-Za-z_][\w\-]*)\s*:")


def detect(source: str) -> bool:
    """Whether a template is Gemma 4's (its call tag or its turn marker)."""
    return CALL_OPEN in source or TURN in source


def parse(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls): each call block whose arguments read as an object and whose function was offered becomes
    a call; the rest stays text."""
    calls: list[ToolCall] = []
    kept, last = [], 0
    for m in _CALL.finditer(text):
        args = arguments(m.group(2).strip())
        if m.group(1) in ctx.known and args is not None:
            calls.append(ToolCall(m.group(1), json.dumps(args, ensure_ascii=False)))
            kept.append(text[last:m.start()])
            last = m.end()
    content = "".join(kept) + text[last:]
    return (content.strip(), calls) if calls else (text, [])


def arguments(body: str) -> dict | None:
    """Gemma 4's call arguments (`{key:<|"|>text<|"|>,n:5,xs:[1,2]}`) as a dict, or None when they are not an
    object: the `<|"|>` strings become JSON strings and the bare keys outside them get quoted."""
    if not body.startswith("{"):
        return None
    parts = body.split(QUOTE)
    if len(parts) % 2 == 0:
        return None  # an unclosed string
    pieces = [json.dumps(p, ensure_ascii=False) if i % 2 else _BARE_KEY.sub(r'\1"\2":', p)
              for i, p in enumerate(parts)]
    try:
        value = json.loads("".join(pieces))
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


FORMATS = (ChatFormat("gemma4", detect=detect, call_markers=(CALL_OPEN,), parse=parse, reasoning=THOUGHT,
                      stop=(TOOL_RESPONSE,), stray=(THOUGHT[0] + "\n", THOUGHT[0], "<|channel>", THOUGHT[1])),)
