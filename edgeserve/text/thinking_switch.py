"""The reasoning switch as chat templates read it: one request's "think" on / off written into every template
variable that templates key reasoning on (`enable_thinking` for Qwen3, `thinking` for DeepSeek V3.1+ / Kimi K3 /
Granite 3.3, `thinking_mode` for MiniMax M3, `thinking_option` for Ling, `reasoning` for Command A reasoning,
`thinking_budget` 0 for Seed-OSS), so a template renders a different prompt for on and off whichever it reads."""

from __future__ import annotations

import re
from typing import Any

# template variable -> (its value for "on", its value for "off"); None: leave it unset (the template's default)
SWITCHES: dict[str, tuple[Any, Any]] = {
    "enable_thinking": (True, False),
    "thinking": (True, False),
    "thinking_mode": ("enabled", "disabled"),
    "thinking_option": ("on", "off"),
    "reasoning": (True, False),
    "thinking_budget": (None, 0),
}


def thinking_kwargs(think: bool, template_source: str, names: tuple[str, ...] = ()) -> dict[str, Any]:
    """Template variables for reasoning on (`think` true) or off: each switch the template's source mentions, and
    `names` (a format's `thinking_switches`, booleans unless SWITCHES says otherwise)."""
    out: dict[str, Any] = {}
    for name in dict.fromkeys((*SWITCHES, *names)):
        if name not in names and not re.search(rf"\b{re.escape(name)}\b", template_source):
            continue
        value = SWITCHES.get(name, (True, False))[0 if think else 1]
        if value is not None:
            out[name] = value
    return out
