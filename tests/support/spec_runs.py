"""Drivers shared by the speculative-decoding tests (MTP heads, Gemma 4 assistants): random prompts, greedy runs, an
oracle that forces drafts to be accepted, and the checks that speculation leaves greedy output and sampling alone."""

from __future__ import annotations

import random

import torch

from edgeserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


class ForcedOracle:
    """A proposer's oracle: records the proposer's own first draft with the sequence it was drafted for, and
    proposes the known greedy continuation with drafts wrong now and then (accepted whole, in part, not at all)."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]], vocab: int, seed: int = 0,
                 accept: float = 0.7) -> None:
        self.runs = list(zip(prompts, outputs))
        self.accept = accept  # each draft's chance of being right
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.seen: list[tuple[list[int], int]] = []

    def __call__(self, seq, drafts: list[int]) -> list[int]:
        tokens = list(seq.all_token_ids)
        self.seen.append((tokens, list(drafts)))
        for prompt, out in self.runs:
            if tokens[:len(prompt)] == prompt:
                future = out[len(tokens) - len(prompt):][:len(drafts)]
                return [t if self.rng.random() < self.accept else (t + 1) % self.vocab for t in future] or drafts
        return drafts


def prompts(seed: int, n: int = 3) -> list[list[int]]:
    """`n` random prompts of 4 to 29 token ids."""
    rnd = random.Random(seed)
    return [[rnd.randrange(3, 2000) for _ in range(rnd.randrange(4, 30))] for _ in range(n)]


def outputs(llm, ps: list[list[int]], params=GREEDY) -> list[list[int]]:
    """The generated token ids of each prompt, run together."""
    return [r.outputs[0].token_ids for r in llm.generate(ps, params)]


def assert_mixed_batch_keeps_greedy(llm, proposer, ps: list[list[int]], ref: list[list[int]]) -> None:
    """With `proposer`'s drafts forced (mostly accepted), a batch mixing greedy requests, a sampled one and one that
    opts out of speculation gives the greedy requests their plain outputs `ref`, the sampled one its 12 tokens."""
    proposer.oracle = ForcedOracle(ps, ref, llm.lm.config.vocab_size, seed=3)
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=12)
    opted_out = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, speculative=False)
    mixed = llm.generate([ps[0], ps[1], ps[2], ps[0]], [GREEDY, sampled, opted_out, GREEDY])
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 3)] == [ref[0], ref[2], ref[0]]
    assert len(mixed[1].outputs[0].token_ids) == 12
    assert llm.engine.spec.counters.accepted > 0


def assert_drafts_carry_distributions(monkeypatch, llm) -> None:
    """Sampled at temperature 1, every verification gets the drafts' distributions q (rows summing to one, each draft
    inside its row, no point mass), which rejection sampling needs to keep the target's distribution."""
    import edgeserve.engine.spec.speculator as speculator

    seen = []
    real = speculator.verify

    def spy(p, drafts, q, generators, deterministic=False):
        seen.append((drafts, q, deterministic))
        return real(p, drafts, q, generators, deterministic)

    monkeypatch.setattr(speculator, "verify", spy)
    outputs(llm, prompts(4), SamplingParams(temperature=1.0, seed=1, max_tokens=10))
    assert seen
    for drafts, q, deterministic in seen:
        assert not deterministic and q is not None
        for d, qs in zip(drafts, q):
            assert torch.allclose(qs.sum(-1), torch.ones(len(d)), atol=1e-4)
            assert all(qs[j, t] > 0 for j, t in enumerate(d))
            assert (qs.max(-1).values < 1).all()  # sampled, not a point mass


def assert_drafts_are_reference_argmax(seen, reference, at_least: int = 6) -> None:
    """Each draft in `seen` ((tokens, drafts) pairs an oracle recorded) is the argmax of its row of
    `reference(tokens, drafts)` (the reference logits, one row per draft), rows with a near-tie passed over; at least
    `at_least` drafts judged."""
    checked = 0
    for tokens, drafts in seen:
        ref = reference(tokens, drafts)
        for j, row in enumerate(ref[: len(drafts)]):
            top = row.topk(2).values
            if top[0] - top[1] > 1e-3:  # never judge a near-tie
                assert drafts[j] == int(row.argmax())
                checked += 1
    assert checked >= at_least
