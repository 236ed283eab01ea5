"""Chat messages to prompt token ids: the one way the server, the `LLM` class and the CLI turn a conversation into
the ids the engine runs."""

from __future__ import annotations

from typing import Any

from edgeserve.loaders.chat_template import ChatTemplate
from edgeserve.loaders.tokenizer import Tokenizer
from edgeserve.text.harmony import harmony_options, render_harmony, template_is_harmony


def chat_prompt_ids(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """Token ids of a prompt the chat template rendered (it wrote the special tokens, BOS included: none are
    added)."""
    return tokenizer.encode(prompt, add_special_tokens=False)


def chat_ids(tokenizer: Tokenizer, template: ChatTemplate, messages: list[dict[str, Any]], **extra: Any) -> list[int]:
    """Token ids of `messages` rendered through the model's chat template with the generation prompt appended;
    `extra` reaches the template (tools=[...], enable_thinking=False, ...). A harmony (gpt-oss) template is
    rendered by edgeserve.text.harmony (`tools`, `reasoning_effort`, `model_identity` from `extra`)."""
    if template_is_harmony(template.source):
        return chat_prompt_ids(tokenizer, render_harmony(messages, extra.get("tools"), harmony_options(extra)))
    return chat_prompt_ids(tokenizer, template.render(messages, add_generation_prompt=True, **extra))
