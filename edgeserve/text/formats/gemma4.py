"""Gemma 4: calls `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:5}<tool_call|>`, one per call (arguments an object
with bare keys and strings between `<|"|>` delimiters); reasoning in a thought channel,
`<|channel>thought\\n...<channel|>` (the newline is missing when the thought is empty).

After a call the template expects `<|tool_response>`: the reply stops there (llama.cpp makes the token end the
turn), so the model never writes a tool's answer itself. Stray channel markers (`<channel|>`, an empty second
thought at the end) never reach the content.

Forced calls are call blocks in this syntax (back to back when parallel), arguments by each tool's schema
(edgeserve.text.formats.gemma4_grammar).
"""

from __future__ import annotations

import json
import re

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall
from edgeserve.text.formats.gemma4_grammar import GENERIC, ArgumentRules
from edgeserve.text.formats.markup import calls_rule, chosen_tools, lit, parameters
from edgeserve.text.grammar import GrammarSpec

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
    if not body.startswith("{") or body.count(QUOTE) % 2:
        return None  # not an object, or an unclosed string
    try:
        value = json.loads(json_text(body))
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def json_text(body: str) -> str:
    """Gemma 4's argument text as JSON text, as far as it goes: `<|"|>` strings as JSON strings (an unclosed last
    one left open), bare keys outside them quoted."""
    parts = body.split(QUOTE)
    pieces = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            pieces.append(_BARE_KEY.sub(r'\1"\2":', part))
        else:
            text = json.dumps(part, ensure_ascii=False)
            pieces.append(text if i < len(parts) - 1 else text[:-1])
    return "".join(pieces)


def forced(tools: list[dict], choice: str | None, parallel: bool) -> GrammarSpec:
    """The grammar of a reply that is `<|tool_call>call:NAME{...}<tool_call|>` blocks (one unless `parallel`),
    arguments in Gemma 4's syntax by each tool's schema."""
    rules, fns = [], []
    for i, tool in enumerate(chosen_tools(tools, choice)):
        params = parameters(tool)
        args = ArgumentRules(params, f"t{i}")
        fns.append(f"fn_{i}")
        rules.append(f"fn_{i}: {lit('call:' + tool['function']['name'])} {args.value(params)}\n")
        rules += args.rules
    head = (f"start: {calls_rule('call', parallel and choice is None)}\n"
            f"call: {lit(CALL_OPEN)} ({' | '.join(fns)}) {lit(CALL_CLOSE)}\n")
    return GrammarSpec("lark", head + "".join(rules) + GENERIC,
                       tokens=(CALL_OPEN, CALL_CLOSE, QUOTE))


_CUT_HEAD = re.compile(r"call:([\w.\-]+)(?=\{)")


def cut(text: str, ctx: CallContext) -> list[ToolCall]:
    """The calls of a forced reply cut short: each block's call (its name complete), the last one's arguments
    as far as they got (JSON text)."""
    calls = []
    for m in re.finditer(re.escape(CALL_OPEN), text):
        head = _CUT_HEAD.match(text, m.end())
        if head is None or head.group(1) not in ctx.known:
            continue
        end = text.find(CALL_CLOSE, head.end())
        body = text[head.end(): end if end >= 0 else len(text)].strip()
        args = arguments(body)
        calls.append(ToolCall(head.group(1), json.dumps(args, ensure_ascii=False) if args is not None
                              else json_text(body)))
    return calls


FORMATS = (ChatFormat("gemma4", detect=detect, call_markers=(CALL_OPEN,), parse=parse, reasoning=THOUGHT,
                      forced=forced, cut=cut,
                      stop=(TOOL_RESPONSE,), stray=(THOUGHT[0] + "\n", THOUGHT[0], "<|channel>", THOUGHT[1])),)
