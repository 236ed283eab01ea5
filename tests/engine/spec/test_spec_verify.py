"""Speculative decoding without a model: rejection sampling reproduces the target distribution exactly, greedy
acceptance stops at the first disagreement, prompt lookup, and block rollback."""

from __future__ import annotations

import pytest
import torch

from edgeserve.engine.cache.kv_blocks import BlockManager
from edgeserve.engine.spec import NgramProposer, token_probs, verify
from edgeserve.engine.spec.verify import draw
from edgeserve.sampling_params import SamplingParams

V, K = 12, 3


def chi_square_ok(counts: torch.Tensor, probs: torch.Tensor, alpha: float = 1e-4) -> bool:
    """Goodness of fit of `counts` to `probs`; tokens outside the support must never appear."""
    n = counts.sum()
    support = probs > 0
    if counts[~support].sum() > 0:
        return False
    expected = probs[support] * n
    stat = ((counts[support] - expected) ** 2 / expected).sum().double()
    dof = torch.tensor(int(support.sum()) - 1, dtype=torch.float64)
    p_value = float(torch.special.gammaincc(dof / 2, stat / 2))  # the chi-square survival function
    return p_value > alpha


def run_batch(p_logits: torch.Tensor, q_logits: torch.Tensor | None, params: SamplingParams, n: int,
              fixed_drafts: list[int] | None = None, seed: int = 0):
    """n independent sequences verifying K drafts each against context-free targets p_0..p_K; returns the
    emitted tokens per sequence and the target distributions."""
    torch.manual_seed(seed)
    p = token_probs(p_logits, [params] * (K + 1))  # [K+1, V]
    if q_logits is None:
        drafts = [list(fixed_drafts)] * n
        q = None
    else:
        qd = token_probs(q_logits, [params] * K)  # [K, V]
        d = torch.stack([torch.multinomial(qd[j], n, replacement=True) for j in range(K)], 1)  # [n, K]
        drafts = d.tolist()
        q = [qd] * n
    verdict = verify(p.repeat(n, 1), drafts, q, [None] * n)
    emitted = [ds[:a] + [t] for ds, a, t in zip(drafts, verdict.num_accepted, verdict.next_token)]
    return emitted, p, verdict


def position_counts(emitted: list[list[int]], j: int) -> torch.Tensor:
    tokens = torch.tensor([e[j] for e in emitted if len(e) > j])
    return torch.bincount(tokens, minlength=V).float()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=6, top_p=0.9),
    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05),
], ids=["plain", "topk-topp", "topp-minp"])
def test_rejection_sampling_reproduces_the_target_distribution(params):
    g = torch.Generator().manual_seed(1)
    p_logits = torch.randn(K + 1, V, generator=g) * 1.5
    q_logits = p_logits[:K] + torch.randn(K, V, generator=g)  # a draft that is often wrong
    emitted, p, verdict = run_batch(p_logits, q_logits, params, n=40000)
    assert 0 < sum(verdict.num_accepted) < K * 40000  # both branches (accept, resample) are exercised
    for j in range(K + 1):  # every position, given it was reached, is distributed as the target's p_j
        counts = position_counts(emitted, j)
        assert counts.sum() > 500
        assert chi_square_ok(counts, p[j]), f"position {j}"
    # the test has power: the draft's own distribution is far from the target's and fails the same check
    q0 = token_probs(q_logits[:1], [params])[0]
    fake = torch.bincount(torch.multinomial(q0, 20000, replacement=True), minlength=V).float()
    assert not chi_square_ok(fake, p[0])


def test_proposals_from_a_draft_vocabulary_reproduce_the_target_distribution():
    """A draft that samples within part of the vocabulary (the MTP head's draft vocabulary: q = 0 outside it, as
    models.mtp_head.full_logits spreads it) still gives exactly the target's distribution, tokens outside included."""
    from edgeserve.models.mtp_head import DraftVocab, full_logits

    params = SamplingParams(temperature=1.0, top_p=0.95)
    g = torch.Generator().manual_seed(3)
    p_logits = torch.randn(K + 1, V, generator=g) * 1.5
    ids = torch.tensor([7, 2, 9, 0, 4, 11])  # half the vocabulary, in no order
    dv = DraftVocab(ids, torch.empty(0), 1.0)
    q_logits = full_logits(dv, (p_logits[:K] + torch.randn(K, V, generator=g))[:, ids], V)
    qd = token_probs(q_logits, [params] * K)
    assert (qd[:, [1, 3, 5, 6, 8, 10]] == 0).all() and (qd.sum(-1) - 1).abs().max() < 1e-5
    emitted, p, verdict = run_batch(p_logits, q_logits, params, n=40000)
    assert 0 < sum(verdict.num_accepted) < K * 40000
    for j in range(K + 1):
        counts = position_counts(emitted, j)
        assert counts[[1, 3, 5, 6, 8, 10]].sum() > 0  # tokens the draft never proposes still come out
        assert chi_square_ok(counts, p[j]), f"position {j}"


def test_point_mass_proposals_reproduce_the_target_distribution():
    params = SamplingParams(temperature=0.9, top_k=8, top_p=0.95)
    g = torch.Generator().manual_seed(2)
    p_logits = torch.randn(K + 1, V, generator=g) * 1.5
    p = token_probs(p_logits, [params] * (K + 1))
    likely = [int(p[j].argmax()) for j in range(K)]  # drafts the target often accepts
    emitted, p, verdict = run_batch(p_logits, None, params, n=40000, fixed_drafts=likely)
    assert sum(verdict.num_accepted) > 0
    for j in range(K + 1):
        assert chi_square_ok(position_counts(emitted, j), p[j]), f"position {j}"


def test_greedy_accepts_while_the_argmax_agrees():
    greedy = SamplingParams(temperature=0.0)
    logits = torch.full((2 * (K + 1), V), -5.0)
    target = [3, 7, 1, 4, 9, 9, 2, 5]  # argmax of each row: seq 0 rows 0..3, seq 1 rows 4..7
    logits[torch.arange(8), torch.tensor(target)] = 5.0
    p = token_probs(logits, [greedy] * 8)
    drafts = [[3, 7, 2], [9, 9, 2]]  # seq 0 breaks at its third draft; seq 1 is all accepted
    for q in (None, [torch.nn.functional.one_hot(torch.tensor(d), V).float() for d in drafts]):
        v = verify(p, drafts, q, [None, None], deterministic=True)
        assert v.num_accepted == [2, 3]
        assert v.next_token == [1, 5]  # the correction, then the bonus token


def test_penalized_greedy_probs_follow_the_sampler():
    from edgeserve.engine.runner.sampler import sample

    logits = torch.randn(4, V)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5)] * 4
    outs = [[int(logits[i].argmax())] for i in range(4)]  # penalize each row's favourite
    prompts = [[0, 1]] * 4
    probs = token_probs(logits, params, prompts, outs)
    assert probs.argmax(-1).tolist() == sample(logits, params, [None] * 4, prompts, outs).tolist()
    assert torch.equal(probs.sum(-1), torch.ones(4))


def test_draw_uses_each_rows_generator():
    """Row i's draws are exactly what its own generator gives alone: not another row's, not a shared stream."""
    seeds = (1, 2, 3)
    probs = torch.full((len(seeds), V), 1.0 / V)  # the same distribution on every row: only the generator differs
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    together = torch.stack([draw(probs, gens) for _ in range(20)], 1)  # [rows, 20 draws]
    for i, s in enumerate(seeds):
        alone = torch.Generator().manual_seed(s)
        assert together[i].tolist() == [int(draw(probs[i:i + 1], [alone])) for _ in range(20)]
    assert len({tuple(r) for r in together.tolist()}) == len(seeds)  # the rows' streams differ


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    ngram = NgramProposer(max_n=3, min_n=1)
    seq = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    assert ngram.propose(seq, 4) == [8, 9, 1, 2]  # [5, 6, 7] matched at the start
    assert ngram.propose(seq, 2) == [8, 9]
    assert ngram.propose([1, 2, 3, 1, 2, 3, 1, 2], 3) == [3, 1, 2]  # the latest match wins
    assert ngram.propose([1, 2, 3, 4], 3) == []  # nothing repeats
    assert ngram.propose([4, 1, 4], 5) == [1, 4]  # a match runs to the end of the sequence at most
    assert ngram.propose([1], 3) == []


def test_truncate_returns_tail_blocks_and_keeps_hashed_ones():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", list(range(6)))
    assert bm.ensure_capacity("a", 6 + 8)  # room for 8 speculative tokens: 4 blocks
    assert bm.num_free_blocks == 4
    bm.commit_full_blocks("a", list(range(9)), 9)  # two full blocks computed and hashed
    bm.truncate("a", 9)  # accepted up to 9 tokens: 3 blocks
    assert len(bm.block_table("a")) == 3 and bm.num_free_blocks == 5
    bm.check_integrity()
    with pytest.raises(ValueError, match="prefix-cached"):
        bm.truncate("a", 4)
    bm.free("a")
    bm.check_integrity()
    assert bm.num_free_blocks == 8
