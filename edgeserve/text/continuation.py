"""Assistant prefill: a conversation rendered so the prompt ends inside its final assistant message, which the
model then continues.

As transformers' `apply_chat_template(..., continue_final_message=...)`: the whole conversation is rendered
without a generation prompt, with a marker appended to the continued field of the final message (its `content`,
or its `reasoning_content` for a reasoning continuation), and the rendered text is cut where the marker stands
(trailing whitespace of the message dropped too when the template trims it, as transformers does). A template that
does not show the final message's reasoning (DeepSeek-R1's drop earlier thoughts) is continued as llama.cpp builds
it instead: the generation prompt, the reasoning's open tag (unless the prompt opened the thought itself), then the
reasoning so far; so is one that refuses a final message of reasoning alone (Ministral 3's). A template that does
not show the final message's content is a ChatTemplateError (a 400).
"""

from __future__ import annotations

from typing import Any

from edgeserve.errors import ChatTemplateError
from edgeserve.loaders.chat_template import ChatTemplate

CONTENT, REASONING = "content", "reasoning"  # what a continuation continues
_MARK = "EDGESERVE_CONTINUE_FINAL_MESSAGE "  # the trailing space tells whether the template trims the message


def continuation_kind(message: dict[str, Any], requested: str) -> str:
    """The field a continuation of the final `message` continues: `requested` ("content" / "reasoning"), or for
    "auto" the reasoning when the message has reasoning and no content yet (as llama.cpp resolves it)."""
    if requested != "auto":
        return requested
    if message.get("reasoning_content") and not message.get("content"):
        return REASONING
    return CONTENT


def render_continuation(template: ChatTemplate, messages: list[dict[str, Any]], kind: str,
                        open_tag: str | None, **extra: Any) -> str:
    """The prompt of `messages`, ending inside the final (assistant) message: after its content (`kind`
    "content") or after its reasoning ("reasoning"; `open_tag` is the template's reasoning open tag, None for a
    template that does not reason). `extra` reaches the template as in ChatTemplate.render."""
    last = dict(messages[-1])
    field = "content" if kind == CONTENT else "reasoning_content"
    text = last.get(field) or ""
    if kind == REASONING and open_tag is None:
        raise ChatTemplateError("the model's template does not reason: there is no reasoning to continue "
                                "(continue the content instead)")
    last[field] = text + _MARK
    if kind == REASONING and "thinking" in last:
        last["thinking"] = last[field]
    try:
        rendered = template.render([*messages[:-1], last], add_generation_prompt=False, **extra)
    except ChatTemplateError:
        if kind == CONTENT:
            raise
        rendered = ""  # the template refuses a message of reasoning alone (Ministral 3's): built below
    at = rendered.rfind(_MARK.strip())
    if at >= 0:
        return rendered[:at] if rendered[at:at + len(_MARK)] == _MARK else rendered[:at].rstrip()
    if kind == REASONING:  # the template drops the final message's reasoning: build it as llama.cpp does
        assert open_tag is not None
        return _thought_opened(template, messages[:-1], open_tag, extra) + text
    raise ChatTemplateError("the model's chat template does not show the final assistant message's content, so "
                            "it cannot be continued")


def _thought_opened(template: ChatTemplate, messages: list[dict[str, Any]], open_tag: str,
                    extra: dict[str, Any]) -> str:
    """The generation prompt of `messages` up to its open reasoning tag and the line break after it (the tag
    added when the generation prompt has none; what it writes after the tag, as a closed empty thought, dropped)."""
    prompt = template.render(messages, add_generation_prompt=True, **extra)
    history = len(template.render(messages, add_generation_prompt=False, **extra))
    tag = open_tag.strip()
    at = prompt.rfind(tag)
    if at < history:
        return prompt + open_tag
    end = at + len(tag)
    return prompt[:end + len(prompt[end:]) - len(prompt[end:].lstrip("\n"))]
