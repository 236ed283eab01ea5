"""A chat request's thinking budget as the engine takes it (engine.sched.thinking_budget.ThinkingBudget): the budget the
API asked (OpenAI `thinking_budget_tokens` / `max_thinking_tokens`, Anthropic `thinking.budget_tokens`) and the
model's own tags, as token ids: its format's reasoning tags (ChatSetup.tags), or harmony's analysis channel and the
final channel's header that ends it."""

from __future__ import annotations

from typing import Any

from edgeserve.engine.sched.thinking_budget import ThinkingBudget
from edgeserve.server.chat_setup import ChatSetup

HARMONY_OPEN = "<|channel|>analysis<|message|>"
HARMONY_CLOSE = "<|end|><|start|>assistant<|channel|>final<|message|>"
MAX_BUDGET = 2**31 - 1


def thinking_spec(budget: int | None, chat: ChatSetup | None, tokenizer: Any) -> ThinkingBudget | None:
    """The engine's budget for one chat reply; None without a budget, or for a model that does not reason (a
    budget there is nothing to enforce) or reasoning shown raw in the content."""
    if budget is None or chat is None or not chat.thinks:
        return None
    if chat.harmony:
        open_tag, close_tag, in_thought = HARMONY_OPEN, HARMONY_CLOSE, False
    else:
        (open_tag, close_tag), in_thought = chat.tags, chat.in_thought
    close_ids = tuple(tokenizer.encode(close_tag, add_special_tokens=False))
    open_ids = tuple(tokenizer.encode(open_tag, add_special_tokens=False))
    if not close_ids:
        return None
    return ThinkingBudget(budget, close_ids, open_ids, in_thought)
