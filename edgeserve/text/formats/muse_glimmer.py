"""muse-glimmer's reply: harmony-like messages after the prompt's `<|start|>assistant`, each ` to=RECIPIENT
<|message|>BODY` ended by `<|eom|>` (more messages follow, each opened by `<|start|>assistant`) or `<|eot|>`:

- ` to=self`: a thought (the format's reasoning tags);
- ` to=user` (or no recipient): the answer;
- ` to=FUNCTION`: a call, its body `<atem:function_calls><atem:invoke name="FUNCTION"><atem:parameter
  name="KEY">VALUE</atem:parameter>...</atem:invoke></atem:function_calls>`, values typed by the tool's schema.

A call counts only as a message of its own (first, or after an `<|eom|>`): markup quoted inside an answer stays
text. The recipient header is a call marker, so the whole answer is held back and unwrapped by the parser.
"""

from __future__ import annotations

import json
import re

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall
from edgeserve.text.formats.tag_blocks import (alternatives, chosen_tools, dumps, keyed_calls, lit, tagged_arg,
                                               text_until, typed_params)
from edgeserve.text.grammar import GrammarSpec

START, MESSAGE, EOM, EOT = "<|start|>assistant", "<|message|>", "<|eom|>", "<|eot|>"
TOKENS = ("<|start|>", MESSAGE, EOM, EOT)
THOUGHT = ("to=self<|message|>", EOM)
CALLS = ("<atem:function_calls>", "</atem:function_calls>")

_MESSAGE = re.compile(r"\s*(?:<\|start\|>assistant)?\s*(?:to=([^<\s]*))?\s*<\|message\|>(.*?)(<\|eom\|>|<\|eot\|>|$)",
                      re.S)
_INVOKE = re.compile(r'\s*<atem:function_calls>\s*<atem:invoke name="([^"]*)">(.*?)</atem:invoke>\s*'
                     r"</atem:function_calls>\s*$", re.S)
_PARAM = re.compile(r'\s*<atem:parameter name="([^"]*)">(.*?)</atem:parameter>\s*', re.S)


def parse_reply(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls) of the messages from the first recipient header on: answers are content, calls to known
    functions are calls; anything that does not read as messages stays content as it is."""
    content, calls, pos, after_eom = [], [], 0, True
    while pos < len(text.rstrip()):
        m = _MESSAGE.match(text, pos)
        if m is None:
            return "".join(content) + text[pos:], calls
        recipient, body, end = m.group(1) or "user", m.group(2), m.group(3)
        call = _call(recipient, body, ctx) if after_eom and recipient not in ("user", "self") else None
        if call is not None:
            calls.append(call)
        else:
            content.append(body if recipient in ("user", "self") else m.group(0))
        after_eom, pos = end == EOM, m.end()
    return "".join(content) + text[pos:], calls


def _call(recipient: str, body: str, ctx: CallContext) -> ToolCall | None:
    m = _INVOKE.match(body)
    if m is None or m.group(1) != recipient or recipient not in ctx.known:
        return None
    args = typed_params(_PARAM, m.group(2), ctx, recipient)
    return None if args is None else ToolCall(recipient, dumps(args))


def forced(tools: list[dict], choice: str | None, parallel: bool) -> GrammarSpec:
    """Call messages only: ` to=NAME<|message|>` and its `<atem:function_calls>` block, several joined by
    `<|eom|><|start|>assistant` when parallel calls are allowed, after at most one ` to=self` thought. The grammar
    covers the thought itself (GrammarSpec.own_thought: the reply's leading space comes before the thought's
    tag, which `think` would not allow)."""
    chosen = chosen_tools(tools, choice)
    header = f"{lit('<|start|>')} \"assistant\""
    body = "call" if not (parallel and choice is None) else f"call ({lit(EOM)} {header} call)*"
    # a thought (` to=self<|message|>...<|eom|>`) may come first; the call is then a new message
    thought = f'" to=self" {lit(MESSAGE)} thought_text {header}'
    rules = [f"start: ({thought})? {body}\n", text_until("thought_text", EOM, (EOM,)),
             f"call: {alternatives(len(chosen))}\n", text_until("str_value", "</atem:parameter>")]

    def call(tool: dict, seq: str) -> str:
        name = tool["function"]["name"]
        return (f'{lit(" to=" + name)} {lit(MESSAGE)} '
                f'{lit(CALLS[0] + chr(10) + "<atem:invoke name=" + json.dumps(name) + ">" + chr(10))} {seq} '
                f'{lit("</atem:invoke>" + chr(10) + CALLS[1])}')

    rules += keyed_calls(chosen, tagged_arg(lambda key: lit(f"<atem:parameter name={json.dumps(key)}>"),
                                            "</atem:parameter>"), call)
    return GrammarSpec("lark", "".join(rules), tokens=TOKENS, own_thought=True)


FORMATS = (
    ChatFormat(name="muse_glimmer", detect=lambda s: "<atem:function_calls>" in s or "atem:invoke" in s,
               call_markers=(START, " to=", MESSAGE), parse=parse_reply, reasoning=THOUGHT, forced=forced,
               priority=20, wraps_answer=True),
)
