"""Generate one sequence at a time with a contiguous KV cache (the reference path `edgeserve run` uses)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from edgeserve.models.attention import ContiguousKV
from edgeserve.models.load import LoadedModel
from edgeserve.sampling_params import SamplingParams
from edgeserve.text.detokenizer import IncrementalDetokenizer

from .sampler import make_generator, sample_tokens


class PromptTooLongError(ValueError):
    """The prompt leaves no room in the model's context for even one new token."""


@dataclass
class TextDelta:
    """What one decode step added: token id, the text now safe to show, and why it stopped (if it did)."""

    token_id: int
    text: str
    finish_reason: str | None = None  # "stop" (end-of-turn token) or "length"
    logprob: float | None = None  # when params.logprobs is set (see SampleOutput for which distribution)
    top_logprobs: list[tuple[int, float]] | None = None  # params.logprobs best (token id, logprob), best first


def generate(lm: LoadedModel, prompt_ids: list[int], params: SamplingParams,
             max_context: int | None = None) -> Iterator[TextDelta]:
    """Stream one completion of `prompt_ids` token by token."""
    model = lm.model
    max_context = min(max_context or model.max_positions, model.max_positions)
    if len(prompt_ids) >= max_context:
        raise PromptTooLongError(
            f"prompt has {len(prompt_ids)} tokens but the context is {max_context} tokens"
        )
    budget = min(params.max_tokens, max_context - len(prompt_ids))
    c = model.config
    kv = ContiguousKV(c.num_layers, len(prompt_ids) + budget, c.num_kv_heads, c.head_dim, model.dtype, model.device)
    generator = make_generator(params)
    detok = IncrementalDetokenizer(lm.tokenizer.decode, prompt_ids, lm.tokenizer.byte_fallback_ids)
    stop_ids = lm.tokenizer.eot_ids
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=model.device)
    output_ids: list[int] = []
    for step in range(budget):
        positions = torch.arange(kv.length, kv.length + len(ids), device=model.device)
        hidden = model.forward(ids, positions, kv)
        kv.advance(len(ids))
        sampled = sample_tokens(model.logits(hidden[-1:]), [params], [generator], [prompt_ids], [output_ids])
        token = int(sampled.token_ids[0])
        output_ids.append(token)
        logprob = top = None
        if params.logprobs is not None:
            logprob = float(sampled.logprobs[0])
            top = list(zip(sampled.top_ids[0].tolist(), sampled.top_logprobs[0].tolist()))
        if token in stop_ids:
            yield TextDelta(token, detok.flush(), "stop", logprob, top)
            return
        last = step == budget - 1
        text = detok.push([token]) + (detok.flush() if last else "")
        yield TextDelta(token, text, "length" if last else None, logprob, top)
        ids = torch.tensor([token], dtype=torch.long, device=model.device)
