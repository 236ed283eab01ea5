"""Swiss AI Apertus: calls as `<|tools_prefix|>[{"NAME": {...arguments...}}, ...]<|tools_suffix|>` (the function's
name is the key), reasoning between `<|inner_prefix|>` and `<|inner_suffix|>`. Detected by `<|tools_prefix|>`.
"""

from __future__ import annotations

import json
from typing import Any

from edgeserve.text.formats.base import CallContext, ChatFormat, ToolCall
from edgeserve.text.formats.markup import arguments_json, call_rules, json_list_reader, list_grammar, lit, scan

TOOLS = ("<|tools_prefix|>", "<|tools_suffix|>")
INNER = ("<|inner_prefix|>", "<|inner_suffix|>")


def _calls(value: Any, ctx: CallContext) -> list[ToolCall] | None:
    """The calls of `[{"NAME": {...}}, ...]`, all to known functions, or None."""
    calls = []
    for item in value if isinstance(value, list) else [value]:
        if not isinstance(item, dict) or len(item) != 1:
            return None
        name, args = next(iter(item.items()))
        text = arguments_json(args)
        if name not in ctx.known or text is None:
            return None
        calls.append(ToolCall(name, text))
    return calls or None


_READERS = {TOOLS[0]: json_list_reader(TOOLS[1], _calls)}


def parse(text: str, ctx: CallContext) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a reply from its first `<|tools_prefix|>` on."""
    return scan(text, _READERS, ctx)


def forced(tools: list[dict], choice: str | None, parallel: bool) -> Any:
    """The grammar of a `<|tools_prefix|>[{"NAME": {...}}, ...]<|tools_suffix|>` reply."""
    from edgeserve.text.grammar import GrammarSpec, json_rule

    rules = call_rules(tools, choice, lambda name, args: f"{lit('{' + json.dumps(name) + ': ')} {args} {lit('}')}",
                       json_rule)
    return GrammarSpec("lark", list_grammar(lit(TOOLS[0]), parallel and choice is None, rules, lit(TOOLS[1])),
                       tokens=(*TOOLS, *INNER))


FORMATS = (
    ChatFormat("apertus", lambda s: TOOLS[0] in s, call_markers=(TOOLS[0],), parse=parse, reasoning=INNER,
               forced=forced, priority=20),
)
