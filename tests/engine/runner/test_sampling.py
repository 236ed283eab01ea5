"""Sampler: distributions checked statistically, seeds, penalties and logprobs exactly, params validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_gguf import write_tiny_llama

from edgeserve.engine.runner.sampler import apply_penalties, make_generator, sample, sample_tokens, token_counts
from edgeserve.sampling_params import SamplingParams

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])  # sorted best first
DRAWS = 20_000


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def expected(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """The exact distribution, written directly from the definitions (LOGITS are sorted already)."""
    p = softmax(LOGITS.double().numpy() / temperature)
    keep = np.ones(len(p), dtype=bool)
    if top_k:
        keep[top_k:] = False
    keep &= (np.cumsum(p) - p) < top_p  # the smallest prefix whose mass reaches top_p
    keep &= p >= min_p * p.max()
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def empirical(params: SamplingParams) -> np.ndarray:
    g = make_generator(params)
    tokens = sample(LOGITS.expand(DRAWS, -1), [params] * DRAWS, [g] * DRAWS)
    return np.bincount(tokens.numpy(), minlength=len(LOGITS)) / DRAWS


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0.5},
        {"temperature": 2.0},
        {"top_k": 3},
        {"top_p": 0.8},
        {"top_p": 0.5, "temperature": 1.5},
        {"min_p": 0.2},
        {"top_k": 5, "top_p": 0.9, "min_p": 0.05, "temperature": 0.8},
    ],
)
def test_distribution_matches_definition(kwargs):
    want = expected(**kwargs)
    got = empirical(SamplingParams(seed=1234, **kwargs))
    assert 0.5 * np.abs(got - want).sum() < 0.02, (got, want)
    assert (got[want == 0] == 0).all()  # truncated tokens never come up


def test_greedy_is_argmax():
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5)] * 16
    assert torch.equal(sample(logits, params, [None] * 16), logits.argmax(-1))


def test_mixed_batch_keeps_greedy_rows_greedy():
    logits = torch.zeros(4, 50)
    logits[:, 7] = 1.0
    params = [SamplingParams(temperature=0.0), SamplingParams(seed=0), SamplingParams(temperature=0.0),
              SamplingParams(seed=1)]
    for _ in range(20):
        out = sample(logits, params, [make_generator(p) for p in params])
        assert out[0] == out[2] == 7


def draw_sequence(seed: int, n: int = 64) -> list[int]:
    params = SamplingParams(seed=seed)
    g = make_generator(params)
    return [int(sample(torch.zeros(1, 1000), [params], [g])[0]) for _ in range(n)]


def test_seeds():
    assert draw_sequence(7) == draw_sequence(7)
    assert draw_sequence(7) != draw_sequence(8)


def test_token_counts_pads_ragged_rows():
    counts = token_counts([[1, 1, 3], [], [4, 0, 9]], vocab=5)  # 9 is outside the vocabulary: ignored
    assert counts.tolist() == [[0, 2, 0, 1, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 1]]


def test_penalties_exact():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 0.0]] * 3)
    params = [
        SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(),  # no penalties: untouched
        SamplingParams(repetition_penalty=0.5),  # < 1 encourages repetition
    ]
    prompt = [[0], [0, 1], [4]]
    output = [[1, 1, 3], [2], []]
    got = apply_penalties(logits, params, prompt, output)
    # row 0: seen = {0, 1, 3}: 2/2, -2*2 - 0.5 - 2*0.25, 0.5/2 - 0.5 - 0.25
    assert torch.allclose(got[0], torch.tensor([1.0, -5.0, 1.0, -0.5, 0.0]))
    assert torch.equal(got[1], logits[1])
    assert torch.equal(got[2], logits[2])  # the only seen token has logit 0
    got = apply_penalties(logits[:1], [SamplingParams(repetition_penalty=0.5)], [[1]], [[0]])
    assert torch.allclose(got[0], torch.tensor([4.0, -1.0, 1.0, 0.5, 0.0]))


def test_penalties_steer_greedy():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    assert sample(logits, [SamplingParams(temperature=0.0)], [None], [[]], [[0]]) == 0
    assert sample(logits, [SamplingParams(temperature=0.0, frequency_penalty=0.2)], [None], [[]], [[0]]) == 1
    assert sample(logits, [SamplingParams(temperature=0.0, repetition_penalty=1.1)], [None], [[0]], [[]]) == 1


def test_logprobs_are_log_softmax_of_processed_logits():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3))
    params = [
        SamplingParams(temperature=0.5, logprobs=5, seed=1, presence_penalty=1.0),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(top_k=4, seed=2),  # asked for none: still gets the batch's columns
    ]
    output = [[0, 1], [0], []]
    out = sample_tokens(logits, params, [make_generator(p) for p in params], [[], [], []], output)
    processed = apply_penalties(logits, params, None, output) / torch.tensor([[0.5], [1.0], [1.0]])
    want = processed.log_softmax(-1)
    assert torch.allclose(out.logprobs, want.gather(1, out.token_ids.unsqueeze(1)).squeeze(1))
    assert out.top_ids.shape == out.top_logprobs.shape == (3, 5)
    assert torch.equal(out.top_ids, want.argsort(-1, descending=True)[:, :5])
    assert torch.allclose(out.top_logprobs, want.gather(1, out.top_ids))
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    assert out.token_ids[1] == out.top_ids[1, 0]  # greedy picks the best


def test_no_logprobs_unless_asked():
    out = sample_tokens(LOGITS.unsqueeze(0), [SamplingParams()], [None])
    assert out.logprobs is None and out.top_ids is None
    out = sample_tokens(LOGITS.unsqueeze(0), [SamplingParams(logprobs=0)], [None])
    assert out.logprobs.shape == (1,) and out.top_ids.shape == (1, 0)


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_k", -1), ("min_p", 1.5), ("seed", 1.5),
        ("repetition_penalty", 0.0), ("repetition_penalty", float("nan")), ("repetition_penalty", float("inf")),
        ("presence_penalty", 2.5), ("frequency_penalty", -2.01), ("frequency_penalty", float("nan")),
        ("logprobs", 21), ("logprobs", -1), ("logprobs", 2.0), ("logprobs", True),
    ],
)
def test_params_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_params_defaults_and_bounds_are_valid():
    SamplingParams(repetition_penalty=1.3, presence_penalty=-2.0, frequency_penalty=2.0, logprobs=20)
    assert SamplingParams().logprobs is None


def test_generate_reports_logprobs_and_honours_penalties(tmp_path):
    from edgeserve.llm import LLM

    llm = LLM(str(write_tiny_llama(tmp_path / "t.gguf")), dtype="float32", kv_cache_gb=0.01)
    prompt = [5, 6, 7]
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True))[0]
    lps = plain.outputs[0].logprobs
    assert len(lps) == len(plain.outputs[0].token_ids) == 12
    assert all(len(d.top) == 3 for d in lps)
    assert all(d.token_id == d.top[0][0] and d.logprob == d.top[0][1] for d in lps)
    # Strong penalties push every token already produced (or in the prompt) below the tiny model's other
    # logits (all within a few units of 0), so greedy decoding never repeats one.
    params = SamplingParams(temperature=0.0, max_tokens=12, frequency_penalty=2.0, repetition_penalty=50.0,
                            ignore_eos=True)
    penalized = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert len(set(penalized + prompt)) == len(penalized) + len(prompt)
    assert len(set(plain.outputs[0].token_ids)) < 12  # without them it does repeat


def _varied_logits(vocab: int = 5000) -> torch.Tensor:
    """Rows from peaked to nearly flat: some keep a handful of tokens, some thousands (no exact ties: which of two
    equal tokens the top-k takes is arbitrary)."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, vocab, generator=g)
    return base * torch.tensor([8.0, 4.0, 2.0, 1.0, 0.3, 0.01]).unsqueeze(1)


FILTERS = [dict(top_p=0.9), dict(top_p=0.99), dict(top_k=40), dict(top_k=1000), dict(min_p=0.05),
           dict(min_p=1e-4), dict(top_k=300, top_p=0.95, min_p=0.01), dict()]


@pytest.mark.parametrize("kwargs", FILTERS)
def test_candidate_draw_equals_the_full_sort(monkeypatch, kwargs):
    """Drawing from each row's top candidates (CPU) gives exactly the tokens of sorting the whole vocabulary, for
    rows whose kept set lies among the candidates and rows that fall back alike; the same seed, the same token."""
    from edgeserve.engine.runner import sampler

    logits = _varied_logits()
    params = [SamplingParams(temperature=0.9, seed=s, **kwargs) for s in range(len(logits))]
    runs = {}
    for width in (sampler.CPU_CANDIDATES, logits.shape[1]):
        monkeypatch.setattr(sampler, "CPU_CANDIDATES", width)
        gens = [make_generator(p) for p in params]
        runs[width] = [sample(logits, params, gens).tolist() for _ in range(30)]
    assert runs[256] == runs[logits.shape[1]]


def test_candidate_path_takes_the_fallback_for_wide_rows(monkeypatch):
    """A flat row under top_p 0.99 keeps thousands of tokens: it cannot be decided from 256 candidates, and its draws
    spread over far more than 256 tokens; a peaked row is decided from the candidates."""
    from edgeserve.engine.runner import sampler

    widths = []
    original_topk, original_sort = torch.Tensor.topk, torch.Tensor.sort

    def topk(self, k, *args, **kwargs):
        widths.append(k)
        return original_topk(self, k, *args, **kwargs)

    def sort(self, *args, **kwargs):  # the fallback sorts the whole vocabulary (a stable sort: ties keep id order)
        widths.append(("sort", self.shape[-1]))
        return original_sort(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "topk", topk)
    monkeypatch.setattr(torch.Tensor, "sort", sort)
    logits = _varied_logits()[[0, 5]]  # peaked, flat
    params = [SamplingParams(top_p=0.99, seed=1), SamplingParams(top_p=0.99, seed=2)]
    gens = [make_generator(p) for p in params]
    draws = torch.stack([sample(logits, params, gens) for _ in range(300)])
    assert widths[:2] == [256, ("sort", 5000)]  # both rows tried the candidates, the flat one fell back
    assert len(set(draws[:, 1].tolist())) > 256
    assert len(set(draws[:, 0].tolist())) < 20


def test_unfiltered_rows_draw_from_the_whole_vocabulary():
    """temperature only (top_p 1, top_k 0, min_p 0): every token can come up, no sort needed."""
    logits = torch.zeros(1, 300)
    params = SamplingParams(seed=5)
    g = make_generator(params)
    seen = {int(sample(logits, [params], [g])[0]) for _ in range(3000)}
    assert len(seen) == 300


def test_logit_bias_steers_greedy_and_sampled_rows_and_logprobs():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    best = logits.argmax(-1)
    params = [SamplingParams(temperature=0, logit_bias={7: 100}),
              SamplingParams(temperature=0, logit_bias={int(best[1]): -100}),
              SamplingParams(temperature=1.0, seed=3, logit_bias={11: 100}, logprobs=1)]
    out = sample_tokens(logits, params, [make_generator(p) for p in params])
    assert out.token_ids[0] == 7 and out.token_ids[2] == 11
    assert out.token_ids[1] != best[1] and out.token_ids[1] == logits[1].topk(2).indices[1]
    # logprobs are of the biased distribution: token 11 is nearly certain
    assert out.logprobs[2] > -1e-3
    assert logits[0].argmax() == best[0]  # the caller's logits are untouched


def test_logit_bias_is_validated():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={True: 1})


def test_tied_logits_put_the_greedy_token_first_in_its_logprobs():
    """bfloat16 logits (a GPU's) tie often: at temperature 0 the emitted token (argmax: the lowest id among the
    tied best) must head its own top-logprobs list, and the tied ones follow in id order."""
    vocab = 1000
    logits = torch.randn(4, vocab) - 5
    best = [(7, 500, 997), (3, 4), (10, 990), (0, 999, 998, 2)]
    for row, ids in enumerate(best):
        logits[row, list(ids)] = 3.0
    out = sample_tokens(logits, [SamplingParams(temperature=0, logprobs=3)] * 4, [None] * 4)
    for row, ids in enumerate(best):
        want = sorted(ids)
        assert out.token_ids[row].item() == want[0]
        assert out.top_ids[row].tolist()[:min(3, len(want))] == want[:3]
        assert out.top_logprobs[row, 0].item() == out.logprobs[row].item()


def test_greedy_tokens_pick_what_torch_argmax_picks():
    """The CPU greedy pick (numpy's argmax) gives torch's index: the first of tied maxima, the first NaN, a row
    of -inf."""
    from edgeserve.engine.runner.sampler import greedy_tokens

    logits = torch.randn(6, 262144, generator=torch.Generator().manual_seed(0))
    logits[1, [70000, 9, 200000]] = 50.0  # a three-way tie: the first wins
    logits[2, [123, 456]] = float("nan")
    logits[3] = float("-inf")
    logits[4, -1] = 99.0
    got = greedy_tokens(logits)
    assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(-1))
    assert got[1].item() == 9 and got[2].item() == 123 and got[4].item() == 262143
    assert torch.equal(greedy_tokens(logits[:, ::2]), logits[:, ::2].argmax(-1))  # a strided view
