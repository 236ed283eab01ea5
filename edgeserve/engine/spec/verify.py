"""Verification of proposed tokens, batched over sequences: greedy acceptance and exact rejection sampling.

Every distribution here is the one the plain sampler draws from (penalties, temperature, top-k / top-p /
min-p, softmax), so the tokens that come out are distributed exactly as without speculation. A greedy row's
distribution is the one-hot of its argmax, which makes greedy acceptance the same code path: a draft token
is accepted iff it is the argmax, and the token after the accepted run is the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgeserve.engine.runner.sampler import apply_penalties, apply_typical, filter_logits, sample_from, scale_by_temperature
from edgeserve.sampling_params import SamplingParams


def token_probs(logits: torch.Tensor, params: list[SamplingParams], prompt_ids: list[list[int]] | None = None,
                output_ids: list[list[int]] | None = None) -> torch.Tensor:
    """The distribution [R, V] each row's token is drawn from: exactly `sample_tokens`' (one-hot argmax for greedy)."""
    logits = apply_penalties(logits.float(), params, prompt_ids, output_ids)
    device = logits.device
    onehot = torch.zeros_like(logits).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    if all(p.greedy for p in params):
        return onehot
    greedy = torch.tensor([p.greedy for p in params], device=device)
    probs = filter_logits(scale_by_temperature(apply_typical(logits, params), params), params).softmax(-1)
    return torch.where(greedy.unsqueeze(1), onehot, probs)


def draw(probs: torch.Tensor, generators: list[torch.Generator | None], deterministic: bool = False) -> torch.Tensor:
    """One token per row of probs [R, V], each from its row's generator (argmax when `deterministic`)."""
    if deterministic:  # one-hot rows: no randomness needed
        return probs.argmax(-1)
    return sample_from(probs, generators)


def draw_drafts(logits: torch.Tensor, seqs: list, params: list[SamplingParams], drafts: list[list[int]],
                generators: list[torch.Generator | None], deterministic: bool) -> tuple[list[int], torch.Tensor | None]:
    """A proposer's next draft token for each row of `logits` (sequence `seqs[r]` with `drafts[r]` drafted so far)
    and the distributions [R, V] they were drawn from: the sampler's own (penalties over the prompt, the output and
    the drafts; temperature and filters), as rejection sampling needs; None for greedy rows without penalties or
    logit biases (their drafts are the argmax, and greedy verification reads no q)."""
    if deterministic and not any(p.penalized or p.logit_bias for p in params):
        return logits.argmax(-1).tolist(), None
    history = any(p.penalized for p in params)
    probs = token_probs(logits, params, [s.prompt_token_ids for s in seqs] if history else None,
                        [s.output_token_ids + d for s, d in zip(seqs, drafts)] if history else None)
    return draw(probs, generators, deterministic).tolist(), probs


@dataclass
class Verdict:
    """Per sequence: how many drafts were accepted, and the token that follows them (correction or bonus)."""

    num_accepted: list[int]
    next_token: list[int]


def verify(target_probs: torch.Tensor, drafts: list[list[int]], draft_probs: list[torch.Tensor] | None,
           generators: list[torch.Generator | None], deterministic: bool = False) -> Verdict:
    """Accept or reject each sequence's drafts against the target.

    `target_probs` [sum(k_s + 1), V]: sequence s's k_s + 1 rows, in order (the distribution at each draft
    position, then the one after the last draft). `drafts[s]`: its k_s >= 1 proposed tokens. `draft_probs[s]`
    [k_s, V]: the distributions they were drawn from; None for a point-mass proposer (prompt lookup).
    Draft j is accepted with probability min(1, p/q); at the first rejection the next token is drawn from
    max(0, p - q) normalized, and when all are accepted from the target's last row.
    """
    device, vocab = target_probs.device, target_probs.shape[-1]
    ks = torch.tensor([len(d) for d in drafts], device=device)
    num_seqs, width = len(drafts), int(ks.max())
    starts = torch.cumsum(ks + 1, 0) - (ks + 1)
    col = torch.arange(width + 1, device=device)
    valid_rows = col.unsqueeze(0) <= ks.unsqueeze(1)  # [S, K+1]
    row_index = torch.where(valid_rows, starts.unsqueeze(1) + col, 0)
    p = target_probs[row_index]  # [S, K+1, V]
    d = torch.zeros(num_seqs, width, dtype=torch.long)
    for s, tokens in enumerate(drafts):  # ragged lists to one padded tensor
        d[s, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    d = d.to(device)
    valid = valid_rows[:, :width]
    if draft_probs is None:
        q = None
        q_d = torch.ones(num_seqs, width, device=device)
    else:
        q = torch.zeros(num_seqs, width, vocab, device=device)
        for s, qs in enumerate(draft_probs):
            q[s, : qs.shape[0]] = qs
        q_d = q.gather(2, d.unsqueeze(2)).squeeze(2)
    p_d = p[:, :width].gather(2, d.unsqueeze(2)).squeeze(2)
    if deterministic:
        u = torch.zeros(num_seqs, width, device=device)
    else:
        u = torch.stack([torch.rand(width, generator=g) for g in generators]).to(device)
    accept = (u * q_d < p_d) & valid  # u < p/q without dividing
    num_accepted = accept.int().cumprod(1).sum(1)
    rows = torch.arange(num_seqs, device=device)
    p_next = p[rows, num_accepted]  # [S, V]
    at = num_accepted.clamp(max=width - 1)
    if q is None:
        q_next = torch.zeros_like(p_next).scatter_(1, d[rows, at].unsqueeze(1), 1.0)
    else:
        q_next = q[rows, at]
    residual = (p_next - q_next).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    rejected = (num_accepted < ks).unsqueeze(1) & (mass > 0)
    dist = torch.where(rejected, residual / mass.clamp_min(1e-30), p_next)
    next_token = draw(dist, generators, deterministic)
    return Verdict(num_accepted.tolist(), next_token.tolist())


def greedy_verify(logits: torch.Tensor, drafts: list[list[int]]) -> Verdict:
    """`verify` for greedy rows without penalties or logit biases, read off the argmax of the logits
    [sum(k_s + 1), V] alone (the same verdict: each row's distribution is the one-hot of its argmax), without
    building [rows, V] distributions."""
    top = logits.argmax(-1).tolist()
    accepted, following, row = [], [], 0
    for d in drafts:
        a = 0
        while a < len(d) and d[a] == top[row + a]:
            a += 1
        accepted.append(a)
        following.append(top[row + a])
        row += len(d) + 1
    return Verdict(accepted, following)


def one_hot(tokens: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """Point-mass distributions [len(tokens), vocab] on `tokens`."""
    return torch.zeros(len(tokens), vocab, device=device).scatter_(1, torch.tensor(tokens, device=device)[:, None], 1.0)
