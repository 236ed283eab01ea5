"""The one validation of a generation request: what the engine refuses up front, before it queues anything."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from edgeserve.errors import InvalidRequestError, PromptTooLongError
from edgeserve.sampling_params import SamplingParams

from .request_state import AttendSpan, ImageRows

if TYPE_CHECKING:
    from edgeserve.models.mrope import MRopePositions


def check_request(prompt_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    """Raise InvalidRequestError (naming the field) or PromptTooLongError unless the engine can run this request.

    SamplingParams checked its own fields when it was built; this checks what needs the model: token ids inside
    the vocabulary, and room in the context for at least one new token.
    """
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty", "prompt")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        bad = next(t for t in prompt_ids if not 0 <= t < vocab_size)
        raise InvalidRequestError(f"prompt token id {bad} is out of range: token ids must be in [0, {vocab_size})",
                                  "prompt")
    if any(not 0 <= t < vocab_size for t in params.logit_bias):
        raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab_size})", "logit_bias")
    if len(prompt_ids) >= max_model_len:
        raise PromptTooLongError(f"the prompt has {len(prompt_ids)} tokens but the context is {max_model_len} "
                                 "tokens, which leaves no room to generate")


def output_budget(requested: int | None, prompt_len: int, max_model_len: int) -> int:
    """The most tokens a request may generate: what it asked (all the context's room when None), never past the
    context (the one cap of max_tokens: a huge client value must not reach the engine's tensors)."""
    return min(requested or max_model_len, max(1, max_model_len - prompt_len))


def check_images(images: Sequence[ImageRows], prompt_len: int, hidden_size: int) -> tuple[ImageRows, ...]:
    """The request's image embedding rows, checked: each [n, hidden_size] (or [n, hidden_size * (1 + k)] with
    Qwen3-VL's k DeepStack features) inside the prompt, none overlapping (InvalidRequestError naming `images`
    otherwise)."""
    end = 0
    for start, rows in sorted(images, key=lambda item: item[0]):
        if rows.dim() != 2 or not rows.shape[1] or rows.shape[1] % hidden_size:
            raise InvalidRequestError(f"image embeddings must be [n, {hidden_size}], got {list(rows.shape)}", "images")
        if start < end or start + rows.shape[0] > prompt_len:
            raise InvalidRequestError("image embeddings must sit inside the prompt without overlapping", "images")
        end = start + rows.shape[0]
    return tuple(images)


def check_mrope(mrope: MRopePositions | None, prompt_len: int, config: Any) -> MRopePositions | None:
    """The request's M-RoPE positions, checked: [3, prompt_len], for a model with M-RoPE (InvalidRequestError
    naming `mrope` otherwise)."""
    if mrope is None:
        return None
    if not getattr(config, "mrope_sections", None):
        raise InvalidRequestError("the model has no M-RoPE positions (only Qwen-VL models take them)", "mrope")
    if tuple(mrope.prompt.shape) != (3, prompt_len):
        raise InvalidRequestError(f"M-RoPE positions must be [3, {prompt_len}], got {list(mrope.prompt.shape)}",
                                  "mrope")
    return mrope


def check_spans(spans: Sequence[AttendSpan], prompt_len: int) -> tuple[AttendSpan, ...]:
    """The request's bidirectional attention spans, checked: [start, end) of at least one token each, inside the
    prompt, none overlapping (InvalidRequestError naming `attend_spans` otherwise); returned sorted."""
    out = tuple(sorted((int(a), int(b)) for a, b in spans))
    end = 0
    for a, b in out:
        if not end <= a < b <= prompt_len:
            raise InvalidRequestError("attention spans must be non-empty [start, end) ranges inside the prompt "
                                      "without overlapping", "attend_spans")
        end = b
    return out
