"""Batched token sampling: penalties, greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from edgeserve.kernels.transfer import to_device
from edgeserve.sampling_params import SamplingParams


@dataclass
class SampleOutput:
    """One step's tokens and, when a row asked for them, logprobs.

    Logprobs are of the distribution the token is drawn from before truncation: log-softmax of the logits
    after penalties and temperature (temperature 1 for greedy rows), before top-k / top-p / min-p.
    """

    token_ids: torch.Tensor  # [B]
    logprobs: torch.Tensor | None = None  # [B] each chosen token's logprob; None when no row asked
    top_ids: torch.Tensor | None = None  # [B, N] best first, N = the largest `logprobs` asked in the batch
    top_logprobs: torch.Tensor | None = None  # [B, N]


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A CPU random generator seeded for this request, or None for the global stream."""
    if params.seed is None:
        return None
    g = torch.Generator()
    g.manual_seed(params.seed)
    return g


def token_counts(token_ids: list[list[int]], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[B, vocab] float counts of each id in each row's list (ids outside the vocabulary are ignored)."""
    rows = [torch.tensor(ids, dtype=torch.long) for ids in token_ids]
    padded = to_device(pad_sequence(rows, batch_first=True, padding_value=vocab).clamp_(0, vocab), torch.long, device)
    counts = torch.zeros(len(rows), vocab + 1, device=device)  # the extra column collects the padding
    counts.scatter_add_(1, padded, torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams], prompt_ids: list[list[int]] | None = None,
                    output_ids: list[list[int]] | None = None) -> torch.Tensor:
    """Logits [B, V] with each row's repetition, presence and frequency penalties applied.

    Repetition (HF/vLLM): logits of tokens seen in the prompt or output are divided by the penalty when
    positive, multiplied when negative. Presence / frequency (OpenAI): subtract `presence` once and
    `frequency` per occurrence for tokens in the output.
    """
    batch, vocab = logits.shape
    if not any(p.penalized for p in params):
        return logits
    use_rep = any(p.repetition_penalty != 1.0 for p in params)
    use_other = any(p.presence_penalty != 0 or p.frequency_penalty != 0 for p in params)
    dev = logits.device
    rep = to_device([p.repetition_penalty for p in params], torch.float32, dev).unsqueeze(1)
    presence = to_device([p.presence_penalty for p in params], torch.float32, dev).unsqueeze(1)
    frequency = to_device([p.frequency_penalty for p in params], torch.float32, dev).unsqueeze(1)
    out_counts = token_counts(output_ids or [[]] * batch, vocab, logits.device)
    if use_rep:
        seen = (token_counts(prompt_ids or [[]] * batch, vocab, logits.device) + out_counts) > 0
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    if use_other:
        logits = logits - frequency * out_counts - presence * (out_counts > 0)
    return logits


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Logits [B, V] with tokens outside each row's top-k / top-p / min-p set to -inf (0 / 1 / 0 = off)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    drop = rank >= k
    probs = sorted_logits.softmax(-1)
    # keep the smallest prefix whose mass reaches top_p (the token that crosses it stays)
    drop |= (probs.cumsum(-1) - probs) >= top_p.unsqueeze(1)
    drop |= probs < (min_p.unsqueeze(1) * probs[:, :1])
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                  prompt_ids: list[list[int]] | None = None,
                  output_ids: list[list[int]] | None = None) -> SampleOutput:
    """One token per row of logits [B, V], each row under its own params and generator, with logprobs if asked.

    `prompt_ids` / `output_ids` (one list per row) are what the penalties look at.
    """
    logits = apply_penalties(logits.float(), params, prompt_ids, output_ids)
    device = logits.device
    # host-side flags and to_device: nothing here waits for the device (see kernels.transfer)
    temperature = to_device([1.0 if p.greedy else p.temperature for p in params], torch.float32, device)
    scaled = logits / temperature.clamp_min(1e-5).unsqueeze(1)
    tokens = logits.argmax(-1)
    if not all(p.greedy for p in params):
        greedy = to_device([p.greedy for p in params], torch.bool, device)
        k = to_device([p.top_k for p in params], torch.long, device)
        tp = to_device([p.top_p for p in params], torch.float32, device)
        mp = to_device([p.min_p for p in params], torch.float32, device)
        probs = filter_logits(scaled, k, tp, mp).softmax(-1)
        # exponential race: argmax(p / E) with E ~ Exp(1) draws from p; each row uses its own generator
        noise = torch.stack([torch.empty(logits.shape[-1]).exponential_(generator=g) for g in generators])
        tokens = torch.where(greedy, tokens, (probs / to_device(noise, torch.float32, device)).argmax(-1))
    out = SampleOutput(tokens)
    top_n = max((p.logprobs for p in params if p.logprobs is not None), default=None)
    if top_n is not None:
        logprobs = scaled.log_softmax(-1)
        out.logprobs = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        out.top_logprobs, out.top_ids = logprobs.topk(top_n, dim=-1)
    return out


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           prompt_ids: list[list[int]] | None = None, output_ids: list[list[int]] | None = None) -> torch.Tensor:
    """One token id per row of logits [B, V] (`sample_tokens` without the logprobs)."""
    return sample_tokens(logits, params, generators, prompt_ids, output_ids).token_ids
