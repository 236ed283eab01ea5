"""Batched token sampling: penalties, greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from edgeserve.kernels.transfer import to_device
from edgeserve.sampling_params import SamplingParams
from edgeserve.text.grammar import GrammarState, allowed_mask

from ..outputs import TokenLogprob


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
    # [B] bool: the row's logits held an inf or NaN (the model's activations overflowed): its token is meaningless,
    # and the engine ends the request with an error instead of a normal stop
    nonfinite: torch.Tensor | None = None


@dataclass
class SamplingRow:
    """What the sampler needs of one sequence that samples this step."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: list[int]
    output_ids: list[int]
    grammar: GrammarState | None = None  # constrained decoding: the mask comes from here
    forced: int | None = None  # the token this row must take (a thinking budget's closing tag), else sampled


def sample_rows(logits: torch.Tensor, rows: list[SamplingRow]) -> SampleOutput:
    """`sample_tokens` over one logits row per SamplingRow (the result stays on the logits' device)."""
    return sample_tokens(logits, [r.params for r in rows], [r.generator for r in rows],
                         [r.prompt_ids for r in rows], [r.output_ids for r in rows], [r.grammar for r in rows],
                         [r.forced for r in rows])


def token_logprobs(sample: SampleOutput, wanted: list[int | None]) -> list[TokenLogprob | None]:
    """Each row's TokenLogprob with its `wanted[i]` best alternatives, or None for rows that did not ask
    (reads the sample on the host)."""
    if sample.logprobs is None:
        return [None] * len(wanted)
    ids, chosen = sample.token_ids.tolist(), sample.logprobs.tolist()
    top_ids, top_lp = sample.top_ids.tolist(), sample.top_logprobs.tolist()
    return [None if n is None else TokenLogprob(ids[i], chosen[i], list(zip(top_ids[i][:n], top_lp[i][:n])))
            for i, n in enumerate(wanted)]


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
    """Logits [B, V] with each row's logit bias, repetition, presence and frequency penalties applied.

    Logit bias (OpenAI): added to the named tokens' logits first. Repetition (HF/vLLM): logits of tokens seen in
    the prompt or output are divided by the penalty when positive, multiplied when negative. Presence / frequency
    (OpenAI): subtract `presence` once and `frequency` per occurrence for tokens in the output. A row's
    `penalty_last_n` narrows all three to its last n tokens of prompt and output (0: none).
    """
    batch, vocab = logits.shape
    dev = logits.device
    if any(p.logit_bias for p in params):
        rows = [i for i, p in enumerate(params) for _ in p.logit_bias]
        cols = [t for p in params for t in p.logit_bias]
        values = [float(v) for p in params for v in p.logit_bias.values()]
        logits = logits.index_put((to_device(rows, torch.long, dev), to_device(cols, torch.long, dev)),
                                  to_device(values, logits.dtype, dev), accumulate=True)
    if not any(p.penalized for p in params):
        return logits
    prompt_ids, output_ids = prompt_ids or [[]] * batch, output_ids or [[]] * batch
    if any(p.penalty_last_n >= 0 for p in params):
        windows = [_window(a, b, p.penalty_last_n) for a, b, p in zip(prompt_ids, output_ids, params)]
        prompt_ids, output_ids = [w[0] for w in windows], [w[1] for w in windows]
    use_rep = any(p.repetition_penalty != 1.0 for p in params)
    use_other = any(p.presence_penalty != 0 or p.frequency_penalty != 0 for p in params)
    rep = to_device([p.repetition_penalty for p in params], torch.float32, dev).unsqueeze(1)
    presence = to_device([p.presence_penalty for p in params], torch.float32, dev).unsqueeze(1)
    frequency = to_device([p.frequency_penalty for p in params], torch.float32, dev).unsqueeze(1)
    out_counts = token_counts(output_ids, vocab, dev)
    if use_rep:
        seen = (token_counts(prompt_ids, vocab, dev) + out_counts) > 0
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    if use_other:
        logits = logits - frequency * out_counts - presence * (out_counts > 0)
    return logits


def _window(prompt_ids: list[int], output_ids: list[int], last_n: int) -> tuple[list[int], list[int]]:
    """The parts of prompt and output that fall in the last `last_n` tokens (all of them for -1)."""
    if last_n < 0:
        return prompt_ids, output_ids
    out = output_ids[max(0, len(output_ids) - last_n):] if last_n else []
    room = last_n - len(out)
    return (prompt_ids[max(0, len(prompt_ids) - room):] if room > 0 else []), out


def apply_typical(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Logits [B, V] with locally typical sampling's cut (typical_p < 1): each such row keeps the tokens whose
    surprise is closest to the row's entropy, fewest first, until their mass reaches typical_p; the rest -inf."""
    rows = [i for i, p in enumerate(params) if p.typical_p < 1.0 and not p.greedy]
    if not rows:
        return logits
    idx = to_device(rows, torch.long, logits.device)
    logp = logits[idx].log_softmax(-1)
    probs = logp.exp()
    entropy = -(probs * logp.nan_to_num(neginf=0.0)).sum(-1, keepdim=True)
    order = (-logp - entropy).abs().argsort(dim=-1, stable=True)
    mass = probs.gather(1, order).cumsum(-1)
    typical = to_device([params[i].typical_p for i in rows], torch.float32, logits.device).unsqueeze(1)
    drop_sorted = (mass - probs.gather(1, order)) >= typical  # the token that crosses typical_p stays
    drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
    out = logits.clone()
    out[idx] = logits[idx].masked_fill(drop, float("-inf"))
    return out


# On CPU a row is drawn from its CPU_CANDIDATES most likely tokens when its top-k / top-p / min-p set lies among
# them, else from a full sort: sorting a 49k vocabulary costs ~30 ms a step at batch 8 there, topk(256) ~2 ms. On a
# GPU the sort is cheap, and deciding which rows fall back would need a device->host sync, so it always sorts.
CPU_CANDIDATES = 256


def _drop_sorted(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Which of the descending `probs` [B, C] (each row's C most likely tokens) top-k / top-p / min-p drop.

    The dropped tokens are a suffix of each row (every rule is monotone in rank), and the first token always stays.
    """
    rank = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
    drop = (top_k.unsqueeze(1) > 0) & (rank >= top_k.unsqueeze(1))
    # keep the smallest prefix whose mass reaches top_p (the token that crosses it stays)
    drop |= (probs.cumsum(-1) - probs) >= top_p.unsqueeze(1)
    drop |= probs < (min_p.unsqueeze(1) * probs[:, :1])
    drop[:, 0] = False
    return drop


def _filters(params: list[SamplingParams], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (to_device([p.top_k for p in params], torch.long, device),
            to_device([p.top_p for p in params], torch.float32, device),
            to_device([p.min_p for p in params], torch.float32, device))


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Logits [B, V] with tokens outside each row's top-k / top-p / min-p set to -inf."""
    sorted_probs, order = logits.softmax(-1).sort(dim=-1, descending=True)
    drop = _drop_sorted(sorted_probs, *_filters(params, logits.device))
    return logits.masked_fill(torch.empty_like(drop).scatter_(1, order, drop), float("-inf"))


def _uniforms(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One U[0, 1) number per row from the row's own generator (the global one for None)."""
    return to_device(torch.cat([torch.rand(1, generator=g) for g in generators]), torch.float32, device)


def _inverse_cdf(probs: torch.Tensor, num_kept: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the index drawn with probability proportional to `probs` [B, C] among its first `num_kept`."""
    cdf = probs.cumsum(-1)
    total = cdf.gather(1, (num_kept - 1).unsqueeze(1)).squeeze(1)
    # below the total, so the draw lands on a token of positive probability within the kept ones
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    index = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
    return torch.minimum(index, num_kept - 1)


def sample_from(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of the distributions `probs` [B, V] (need not be normalized), each from its own generator."""
    full = torch.full((probs.shape[0],), probs.shape[-1], dtype=torch.long, device=probs.device)
    return _inverse_cdf(probs, full, _uniforms(generators, probs.device))


def _draw(scaled: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of the temperature-scaled logits [B, V] under each row's top-k / top-p / min-p."""
    batch, vocab = scaled.shape
    dev = scaled.device
    probs = scaled.softmax(-1)
    u = _uniforms(generators, dev)  # one number per row, whatever path the row takes: seeds stay reproducible
    tokens = torch.empty(batch, dtype=torch.long, device=dev)
    free = [i for i, p in enumerate(params) if not p.filtered]
    if free:  # the whole vocabulary, in any order: no sort
        rows = to_device(free, torch.long, dev)
        tokens[rows] = _inverse_cdf(probs[rows], torch.full((len(free),), vocab, device=dev), u[rows])
    pending = [i for i, p in enumerate(params) if p.filtered]
    width = min(CPU_CANDIDATES, vocab) if dev.type == "cpu" else vocab
    while pending:
        rows = to_device(pending, torch.long, dev)
        if width == vocab:  # a stable sort: tied probabilities (frequent in bfloat16) keep token id order
            top_probs, top_ids = probs[rows].sort(dim=-1, descending=True, stable=True)
        else:
            top_probs, top_ids = probs[rows].topk(width, dim=-1)
        drop = _drop_sorted(top_probs, *_filters([params[i] for i in pending], dev))
        picked = top_ids.gather(1, _inverse_cdf(top_probs, (~drop).sum(-1), u[rows]).unsqueeze(1)).squeeze(1)
        if width == vocab:
            tokens[rows] = picked
            break
        # a row whose last candidate is dropped keeps only candidates (drops are a suffix); the rest sort everything
        inside = drop[:, -1].tolist()
        done = [j for j, ok in enumerate(inside) if ok]
        tokens[rows[done]] = picked[done]
        pending = [i for i, ok in zip(pending, inside) if not ok]
        width = vocab
    return tokens


def scale_by_temperature(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Logits [B, V] divided by each row's temperature (1 for greedy rows)."""
    temperature = to_device([1.0 if p.greedy else p.temperature for p in params], torch.float32, logits.device)
    return logits / temperature.clamp_min(1e-5).unsqueeze(1)


def apply_grammars(logits: torch.Tensor, grammars: list[GrammarState | None] | None) -> torch.Tensor:
    """Logits [B, V] with the tokens each constrained row's grammar forbids set to -inf (one masked_fill over the
    constrained rows; rows without a grammar are untouched, and a batch without any costs one Python check)."""
    rows = [i for i, g in enumerate(grammars or ()) if g is not None]
    if not rows:
        return logits
    allowed = allowed_mask([grammars[i] for i in rows], logits.shape[-1]).to(logits.device, non_blocking=True)
    if len(rows) == logits.shape[0]:
        return logits.masked_fill(~allowed, float("-inf"))
    forbidden = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    forbidden[to_device(rows, torch.long, logits.device)] = ~allowed
    return logits.masked_fill(forbidden, float("-inf"))


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The first index of each row's largest logit (a NaN counts as the largest), int64 [B]. On the CPU through
    numpy, whose SIMD argmax is about 10x torch's over a 262k-token vocabulary (Gemma); same index."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[0]:
        return torch.from_numpy(logits.contiguous().numpy().argmax(-1).astype(np.int64))
    return logits.argmax(-1)


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                  prompt_ids: list[list[int]] | None = None,
                  output_ids: list[list[int]] | None = None,
                  grammars: list[GrammarState | None] | None = None,
                  forced: list[int | None] | None = None) -> SampleOutput:
    """One token per row of logits [B, V], each row under its own params and generator, with logprobs if asked.

    `prompt_ids` / `output_ids` (one list per row) are what the penalties look at; `grammars` (one per row, None
    for unconstrained rows) mask each constrained row to the tokens its grammar allows next; `forced` (one per row,
    None to sample) gives rows their token outright (its logprob is still reported as the model's).
    """
    logits = logits.float()
    nonfinite = ~torch.isfinite(logits.sum(-1))  # one reduction: any inf or NaN in a row makes its sum non-finite
    logits = apply_grammars(apply_penalties(logits, params, prompt_ids, output_ids), grammars)
    device = logits.device
    tokens = greedy_tokens(logits)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    top_n = max((p.logprobs for p in params if p.logprobs is not None), default=None)
    out = SampleOutput(tokens, nonfinite=nonfinite)
    if not sampled and top_n is None:
        _force(tokens, forced)
        return out
    # host-side flags and to_device: nothing here waits for the device (see kernels.transfer)
    scaled = scale_by_temperature(logits, params)
    if sampled:
        rows = to_device(sampled, torch.long, device)
        typical = apply_typical(logits, params)  # truncation: the logprobs below stay before it
        drawn = scaled if typical is logits else scale_by_temperature(typical, params)
        tokens[rows] = _draw(drawn[rows], [params[i] for i in sampled], [generators[i] for i in sampled])
    _force(tokens, forced)
    if top_n is not None:
        logprobs = scaled.log_softmax(-1)
        out.logprobs = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        out.top_logprobs, out.top_ids = top_logprobs(logprobs, top_n)
    return out


def _force(tokens: torch.Tensor, forced: list[int | None] | None) -> None:
    """Put each forced row's token in place (a Python check for batches without any)."""
    rows = [i for i, t in enumerate(forced or ()) if t is not None]
    if rows:
        tokens[to_device(rows, torch.long, tokens.device)] = to_device([forced[i] for i in rows], torch.long,
                                                                      tokens.device)


TIE_SLACK = 8  # extra candidates, so that the tokens tied at the n-th place are in the set before it is ordered


def top_logprobs(logprobs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's n best (logprobs, token ids) of logprobs [B, V], best first, equal logprobs in token id order:
    the order argmax breaks ties in, so at temperature 0 the emitted token heads its own list (topk alone leaves
    the order of ties unspecified, and bfloat16 logits on a GPU tie often)."""
    values, ids = logprobs.topk(min(logprobs.shape[-1], n + TIE_SLACK), dim=-1)
    ids, order = ids.sort(dim=-1)
    values, order = values.gather(1, order).sort(dim=-1, descending=True, stable=True)
    return values[:, :n], ids.gather(1, order)[:, :n]


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           prompt_ids: list[list[int]] | None = None, output_ids: list[list[int]] | None = None,
           grammars: list[GrammarState | None] | None = None) -> torch.Tensor:
    """One token id per row of logits [B, V] (`sample_tokens` without the logprobs)."""
    return sample_tokens(logits, params, generators, prompt_ids, output_ids, grammars).token_ids
