"""Batched token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds."""

from __future__ import annotations

import torch

from edgeserve.sampling_params import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A CPU random generator seeded for this request, or None for the global stream."""
    if params.seed is None:
        return None
    g = torch.Generator()
    g.manual_seed(params.seed)
    return g


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor) -> torch.Tensor:
    """Logits [B, V] scaled by temperature with tokens outside top-k / top-p / min-p set to -inf."""
    logits = logits / temperature.clamp_min(1e-5).unsqueeze(1)
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


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token id per row of logits [B, V], each row under its own params and generator."""
    logits = logits.float()
    greedy = torch.tensor([p.greedy for p in params])
    out = logits.argmax(-1)
    if bool(greedy.all()):
        return out
    t = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params])
    k = torch.tensor([p.top_k for p in params])
    tp = torch.tensor([p.top_p for p in params])
    mp = torch.tensor([p.min_p for p in params])
    probs = filter_logits(logits, t, k, tp, mp).softmax(-1)
    # exponential race: argmax(p / E) with E ~ Exp(1) draws from p; each row uses its own generator
    noise = torch.stack([torch.empty(logits.shape[-1]).exponential_(generator=g) for g in generators])
    sampled = (probs / noise).argmax(-1)
    return torch.where(greedy, out, sampled)
