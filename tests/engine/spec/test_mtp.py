"""Speculation with the model's own MTP head (issue 50): tiny random Qwen3.5 checkpoints (dense and MoE) with an MTP
block made in transformers, converted by llama.cpp's own convert_hf_to_gguf.py with the block kept.

- the head's logits (GGUF and HF folder) are those computed from the checkpoint's `mtp.*` weights (mtp_reference);
- inside the engine, each first and second draft is the reference head's argmax for the sequence so far, through
  prompt chunks, accepted, partly accepted and rejected drafts (an oracle forces acceptance: random heads never agree
  with random trunks);
- greedy output with MTP on is MTP off's token for token, alone and in a mixed batch, per-op (f32) and on the fused
  native stack (Q8_0);
- `auto` turns MTP on for a file with a head and leaves a file without one alone; `mtp` on such a file is one line;
- at temperature > 0 the drafts' distributions go to rejection sampling (verify's own tests check it keeps the
  target's distribution);
- a draft vocabulary (`--spec-draft-vocab`: the head's output matrix cut to some token ids) gives the full head's
  logits of those ids, drafts map back to their token ids, and greedy output does not change.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from converter_cases import BY_NAME  # noqa: E402
from converter_parity import IDS, build_checkpoint, convert, load_ours, max_logprob_diff, tokenizer_folder  # noqa: E402
from mtp_reference import mtp_reference_logits  # noqa: E402
from support.spec_runs import (GREEDY, ForcedOracle, assert_drafts_are_reference_argmax,  # noqa: E402
                               assert_drafts_carry_distributions, assert_mixed_batch_keeps_greedy, outputs, prompts)

from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention  # noqa: E402
from edgeserve.engine.spec import NoMtpHeadError  # noqa: E402
from edgeserve.engine.spec.speculator import MAX_BACKLOG  # noqa: E402
from edgeserve.kernels.dispatch import AttentionMetadata  # noqa: E402
from edgeserve.llm import LLM  # noqa: E402
from edgeserve.models.mtp_head import cut_vocab, draft_logits, head_decoder, mtp_forward, mtp_logits  # noqa: E402
from edgeserve.sampling_params import SamplingParams  # noqa: E402

CASES = ["qwen35-mtp", "qwen35moe-mtp"]
F32_BOUND = 2e-4  # float32 noise, as in test_converter_parity


@pytest.fixture(scope="module")
def files(default_model_path: Path, tmp_path_factory):
    """get(name) -> (transformers model, HF folder, f32 GGUF, Q8_0 GGUF), made once a module."""
    made: dict = {}
    tok = tokenizer_folder(default_model_path, tmp_path_factory.mktemp("tokenizer"))

    def get(name: str):
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            model = build_checkpoint(BY_NAME[name], tok, folder)
            made[name] = (model, folder, convert(folder, folder.parent / f"{name}.f32.gguf"),
                          convert(folder, folder.parent / f"{name}.q8.gguf", outtype="q8_0"))
        return made[name]

    return get


def head_logits(model, ids: list[int], hidden: torch.Tensor, chunks: list[tuple[int, int]]) -> torch.Tensor:
    """Our head's logits for rows (ids[i + 1], hidden[i]), run in `chunks` over its paged pool (blocks of 4)."""
    pool = KVPool(model.mtp.kv_config, 8, 4, model.dtype)
    out = []
    for a, b in chunks:
        meta = AttentionMetadata.build([b - a], [b], [list(range(8))], list(range(a, b)))
        g = mtp_forward(model, model.mtp, torch.tensor(ids[a + 1: b + 1]), hidden[a:b], torch.arange(a, b),
                        PagedKVAttention(pool, meta))
        out.append(mtp_logits(model, model.mtp, g))
    return torch.cat(out)


@pytest.mark.parametrize("name", CASES)
def test_head_logits_equal_the_reference_from_the_hf_weights(name, files):
    hf, folder, gguf, _ = files(name)
    ref = mtp_reference_logits(hf, folder, IDS)
    assert ref.abs().max() > 1.0
    with torch.no_grad():
        hidden = hf.model(input_ids=torch.tensor([IDS])).last_hidden_state[0, :-1]
    t = len(IDS) - 1
    for path in (gguf, folder):
        model = load_ours(path).model
        assert model.mtp is not None and (model.mtp.layer.moe is not None) == ("moe" in name)
        ours = head_logits(model, IDS, hidden, [(0, 9), *((i, i + 1) for i in range(9, t))])
        assert max_logprob_diff(ours, ref) < F32_BOUND


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("draft_vocab", [0, 1500])
def test_engine_first_drafts_are_the_reference_heads(name, draft_vocab, files):
    """Each first draft is the argmax of the reference head over the whole sequence so far (its K/V kept through
    prompt chunks, verified steps and a hybrid's rolled-back ones), and each second draft the reference's for the
    row after (the first draft and the head's own output); with a draft vocabulary, the argmax over its token ids."""
    hf, folder, gguf, _ = files(name)
    lm = load_ours(gguf)
    ps = prompts(1, 2)
    plain = outputs(LLM.from_model(lm, kv_cache_gb=0.01, speculative="off"), ps)
    spec = LLM.from_model(lm, kv_cache_gb=0.01, speculative="mtp", num_speculative_tokens=3, max_num_batched_tokens=16,
                          block_size=4, spec_draft_vocab=draft_vocab)
    assert (spec.engine.spec.mtp.draft_vocab is not None) == (draft_vocab > 0)
    spec.engine.spec.backoff = None  # every step drafts (a paused request's head starts again: not this test's case)
    oracle = spec.engine.spec.mtp.oracle = ForcedOracle(ps, plain, lm.config.vocab_size)
    rows, execute = [], spec.engine.runner.execute

    def spy(step, fill=None):
        rows.extend(s.num_new_tokens - s.num_spec for s in step.scheduled if s.num_spec)
        return execute(step, fill)

    spec.engine.runner.execute = spy
    assert outputs(spec, ps) == plain
    c = spec.engine.spec.counters
    assert 0 < c.accepted < c.proposed  # drafts accepted and rejected
    # after a partly rejected step the hybrid computes its accepted tokens again beside its next drafts, but never
    # more than MAX_BACKLOG of them (then a step without drafts keeps them)
    assert 1 < max(rows) <= MAX_BACKLOG + 1

    def reference(tokens, drafts):
        ref = mtp_reference_logits(hf, folder, tokens, drafts[:1])[-2:]
        return ref[:, :draft_vocab] if draft_vocab else ref

    assert_drafts_are_reference_argmax(oracle.seen[::3], reference)


def assert_spec_pools_empty(llm: LLM) -> None:
    bm = llm.engine.spec.mtp.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.spec.mtp.seqs


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("weights", ["f32", "q8"])
def test_greedy_with_mtp_is_greedy_without(name, weights, files):
    """Alone and in a mixed batch (a sampled request and one that opts out beside greedy ones), per-op (f32) and
    fused (Q8_0), with the head's own drafts and with forced acceptance."""
    _, _, f32, q8 = files(name)
    lm = load_ours(f32 if weights == "f32" else q8, dtype="float32" if weights == "f32" else "bfloat16")
    assert (lm.model.native_decoder() is not None) == (weights == "q8")
    ps = prompts(2)
    off = LLM.from_model(lm, kv_cache_gb=0.01, speculative="off")
    assert off.engine.spec is None
    plain = outputs(off, ps)
    auto = LLM.from_model(lm, kv_cache_gb=0.01)  # auto: the file has a head
    # 2 drafts a step for a dense model's head, 1 for an MoE's (--spec-tokens' defaults, measured)
    assert auto.engine.spec.method == "mtp" and auto.engine.spec.num_tokens == (1 if lm.config.is_moe else 2)
    assert lm.config.is_moe == ("moe" in name)
    # fused: a verification step keeps its drafts off the Gated DeltaNet states and replays the accepted ones
    assert auto.engine.runner.replay_drafts == (weights == "q8")
    assert auto.engine.spec.mtp.draft_vocab is not None  # the default draft vocabulary cuts this head
    assert [outputs(auto, [p])[0] for p in ps] == plain
    assert auto.engine.spec.counters.proposed > 0
    full = LLM.from_model(lm, kv_cache_gb=0.01, speculative="mtp", num_speculative_tokens=2, spec_draft_vocab=0)
    assert full.engine.spec.mtp.draft_vocab is None
    assert outputs(full, ps) == plain and full.engine.spec.counters.proposed > 0
    assert_mixed_batch_keeps_greedy(auto, auto.engine.spec.mtp, ps, plain)
    stats = auto.engine.stats()  # what /metrics exports (edgeserve_spec_*)
    assert (stats.spec_proposed_tokens, stats.spec_accepted_tokens) == (auto.engine.spec.counters.proposed,
                                                                        auto.engine.spec.counters.accepted)
    assert 0 < stats.spec_acceptance_rate <= 1 and stats.spec_mean_accepted_length > 1
    assert_spec_pools_empty(auto)


def test_a_step_off_the_fused_stack_backs_the_states_up_instead(files):
    """With the model's fused plan set aside after the engine was made (steps run per-op), verification steps take
    the state backup / restore and recompute instead of keeping their drafts off the states: greedy output unchanged."""
    _, _, _, q8 = files(CASES[0])
    lm = load_ours(q8, dtype="bfloat16")
    llm = LLM.from_model(lm, kv_cache_gb=0.01, speculative="mtp", num_speculative_tokens=2, spec_draft_vocab=0)
    off = LLM.from_model(lm, kv_cache_gb=0.01, speculative="off")
    assert llm.engine.runner.replay_drafts
    fused, lm.model._native = lm.model._native, None
    try:
        assert not llm.engine.runner.replays_now()
        ps = prompts(2)
        assert outputs(llm, ps) == outputs(off, ps) and llm.engine.spec.counters.proposed > 0
    finally:
        lm.model._native = fused


def test_owed_drafts_run_in_the_next_step_and_snapshots_land_inside_a_verification(files, monkeypatch):
    """Fused, the accepted drafts are owed to the sequence's next step (RecurrentStep.defer) instead of replayed at
    once: that step runs them in its own pass, and a snapshot of the slot settles them first, all but the rows past
    the block a verification step crossed, so a speculating hybrid keeps a snapshot at every block boundary as
    plain decoding does (replayed at once, only where a step ends exactly on one). Over a conversation's two turns
    (the second: the first turn's prompt and answer and a new message, resuming from a snapshot) outputs are plain
    decoding's, and the snapshots are plain decoding's, bit for bit."""
    from edgeserve.kernels.cpu.recurrent_step import OwedDrafts

    _, _, _, q8 = files(CASES[0])
    lm = load_ours(q8, dtype="bfloat16")
    recurrent = lm.model.native_decoder().recurrent
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    first = [[(37 * i + 11) % 1900 + 3 for i in range(29)]]
    answer = outputs(LLM.from_model(lm, kv_cache_gb=0.01, speculative="off"), first, params)[0]
    turns = [first[0], first[0] + answer + prompts(7, 1)[0]]
    settled, taken = [], []
    monkeypatch.setattr(OwedDrafts, "settle", lambda self, pool, slot, rows=None, f=OwedDrafts.settle: (
        settled.append(rows), f(self, pool, slot, rows))[1])

    def run(spec: str, defer: bool = True):
        recurrent.defer = defer
        llm = LLM.from_model(lm, kv_cache_gb=0.01, speculative=spec, num_speculative_tokens=2, spec_draft_vocab=0)
        pool = llm.engine.states.pool
        take = pool.take_owed
        monkeypatch.setattr(pool, "take_owed", lambda slots, f=take: (taken.append(f(slots)), taken[-1])[1])
        if spec == "mtp":
            llm.engine.spec.backoff = None
            llm.engine.spec.mtp.oracle = ForcedOracle(turns, plain, lm.config.vocab_size, accept=0.8)
        got = [outputs(llm, [p], params)[0] for p in turns]
        assert not pool.owed  # finished sequences owe nothing
        states = llm.engine.states
        return got, states.counters, {h: [t[slot].clone() for t in pool.tensors.values()]
                                      for h, slot in states._snapshots.items()}

    plain, counters, want = run("off")
    assert len(want) > 2 and counters.prompt_tokens_from_states > len(first[0])  # resumed inside the answer
    settled.clear(), taken.clear()
    outs, got_counters, got = run("mtp", defer=True)
    assert outs == plain and got.keys() == want.keys()
    assert all(all(torch.equal(a, b) for a, b in zip(got[h], want[h])) for h in want)
    assert got_counters.prompt_tokens_from_states == counters.prompt_tokens_from_states
    assert any(rows is not None for rows in settled)  # a snapshot inside a verification's rows
    assert any(any(o) for o in taken)  # owed rows run by the next step
    settled.clear(), taken.clear()
    outs, replayed_counters, replayed = run("mtp", defer=False)
    recurrent.defer = True
    assert outs == plain and not settled and not any(any(o) for o in taken)
    assert replayed.keys() <= want.keys()
    assert all(all(torch.equal(a, b) for a, b in zip(replayed[h], want[h])) for h in replayed)


@pytest.mark.parametrize("weights", ["f32", "q8"])
def test_draft_vocabulary_rows_map_back_to_their_token_ids(weights, files):
    """A head cut to token ids in no particular order gives the full head's logits of those ids (the output matrix's
    rows: dense, or q8_0 blocks re-cut), and the proposer's drafts are those ids: the argmax among them (greedy), or
    samples of a distribution that is 0 outside them."""
    _, _, f32, q8 = files("qwen35-mtp")
    lm = load_ours(f32 if weights == "f32" else q8, dtype="float32" if weights == "f32" else "bfloat16")
    model, vocab = lm.model, lm.config.vocab_size
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:700]
    dv = cut_vocab(model, model.mtp, ids)
    assert dv is not None and type(dv.matrix) is type(model.lm_head)
    g = torch.randn(5, lm.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(model.dtype) * 3
    full = mtp_logits(model, model.mtp, g)[:, :vocab]
    ours = draft_logits(dv, g)
    assert ours.shape == (5, 700) and torch.allclose(ours, full[:, ids], rtol=1e-3, atol=1e-3)
    proposer = LLM.from_model(lm, kv_cache_gb=0.01, speculative="mtp").engine.spec.mtp
    proposer.draft_vocab = dv
    tokens, q = proposer._draw(g, [None] * 5, [GREEDY] * 5, [[] for _ in range(5)], [None] * 5, True)
    assert q is None and tokens == ids[full[:, ids].argmax(-1)].tolist()
    assert any(t != int(i) for t, i in zip(tokens, full.argmax(-1)))  # the cut changed some drafts
    hot = SamplingParams(temperature=1.0)
    gens = [torch.Generator().manual_seed(i) for i in range(5)]
    tokens, q = proposer._draw(g, [None] * 5, [hot] * 5, [[] for _ in range(5)], gens, False)
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[ids] = False
    assert q.shape == (5, vocab) and torch.allclose(q.sum(-1), torch.ones(5), atol=1e-4)
    assert (q[:, outside] == 0).all() and all(q[r, t] > 0 for r, t in enumerate(tokens))


@pytest.mark.parametrize("weights", ["f32", "q8"])
def test_preemption_drops_the_heads_state_and_recomputes(weights, files):
    """A budget of a few blocks: sequences are preempted and recomputed with MTP on, per-op and fused (where a
    preempted sequence's slot drops the drafts it still owed its states); outputs are plain decoding's and the
    head's pool ends empty."""
    _, _, f32, q8 = files("qwen35-mtp")
    lm = load_ours(f32 if weights == "f32" else q8, dtype="float32" if weights == "f32" else "bfloat16")
    ps = [p + p[:10] for p in prompts(5, 4)]
    # enough to outgrow the blocks: the bfloat16 pool (fused) fits twice the float32 one's in the same budget
    params = SamplingParams(temperature=0.0, max_tokens=20 if weights == "f32" else 60, ignore_eos=True)
    plain = outputs(LLM.from_model(lm, kv_cache_gb=0.01, speculative="off"), ps, params)
    probe = LLM.from_model(lm, kv_cache_gb=0.01, speculative="mtp")
    pool = probe.engine.pool
    block = (pool.k[:, 0].numel() + pool.v[:, 0].numel()) * pool.k.element_size()
    budget = 8 * probe.engine.states.budget.bytes_per_slot + block
    small = LLM.from_model(lm, kv_cache_gb=budget / 2**30, max_num_seqs=4, enable_prefix_caching=False,
                           speculative="mtp")
    assert small.engine.runner.replays_now() == (weights == "q8")
    state_pool, dropped = small.engine.states.pool, []
    free = state_pool.free
    state_pool.free = lambda slot: (dropped.append(slot in state_pool.owed), free(slot))[1]
    small.engine.spec.backoff = None
    small.engine.spec.mtp.oracle = ForcedOracle(ps, plain, lm.config.vocab_size)
    assert outputs(small, ps, params) == plain
    assert any(dropped) == (weights == "q8")  # fused: a preempted slot still owed drafts
    assert small.engine.stats().num_preemptions > 0 and small.engine.spec.counters.accepted > 0
    assert_spec_pools_empty(small)


def test_temperature_drafts_carry_their_distributions_to_verification(files, monkeypatch):
    """At temperature > 0 the MTP drafts come with the distributions q they were drawn from (a real distribution,
    each draft inside it), which rejection sampling needs to keep the target's distribution (test_spec_verify)."""
    _, _, gguf, _ = files("qwen35-mtp")
    assert_drafts_carry_distributions(monkeypatch, LLM.from_model(load_ours(gguf), kv_cache_gb=0.01, speculative="mtp"))


def test_auto_leaves_a_file_without_a_head_alone_and_mtp_refuses_it(tmp_path, capsys):
    from tiny_gguf import write_tiny_llama

    from edgeserve.cli import main

    path = write_tiny_llama(tmp_path / "tiny.gguf")
    lm = load_ours(path)
    assert LLM.from_model(lm, kv_cache_gb=0.01).engine.spec is None
    with pytest.raises(NoMtpHeadError, match="has no MTP head"):
        LLM.from_model(lm, kv_cache_gb=0.01, speculative="mtp")
    assert main(["run", str(path), "hi", "--speculative", "mtp", "--max-tokens", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no MTP head" in err[0] and "Traceback" not in err[0]


def test_backoff_pauses_a_request_with_low_acceptance_and_probes_again():
    from edgeserve.engine.spec.backoff import Backoff

    b = Backoff(threshold=0.4)
    assert b.drafts_now("first") and not b.paused("first")  # a new request in a new engine drafts
    b.forget("first")
    steps = []
    for _ in range(80):
        if b.drafts_now("low"):
            b.record("low", 2, 0)  # never accepted
            steps.append(1)
        else:
            steps.append(0)
    drafted = [i for i, s in enumerate(steps) if s]
    gaps = [b - a - 1 for a, b in zip(drafted, drafted[1:])]
    assert gaps[:4] == [0, 4, 8, 16]  # two bad verifications pause it (surely low), then pauses that double
    # a new request starts from the engine's acceptance: after "low", surely under the threshold, it starts paused
    assert b.paused("good") and [b.drafts_now("good") for _ in range(b.first_pause + 1)] == [False] * b.first_pause + [True]
    for _ in range(20):
        b.record("good", 2, 2)
        assert b.drafts_now("good")
    waits = []
    for _ in range(4):  # good probes after the pause: each pause shorter, then drafting again once the average is
        n = 0           # back above the threshold
        while not b.drafts_now("low"):
            n += 1
        waits.append(n)
        b.record("low", 2, 2)
    assert waits[1] < waits[0] and waits[2] < waits[1] and waits[-1] == 0
    assert b.drafts_now("low") and b.drafts_now("low")


def test_backoff_keeps_drafting_above_the_break_even_and_pauses_below_it():
    """At acceptance 0.7 over a break-even of 0.5 a request (almost) never pauses; at 0.4 under a break-even of 0.7
    (an MoE's) it drafts on few steps."""
    import random

    from edgeserve.engine.spec.backoff import Backoff

    def drafting_share(accept: float, threshold: float, k: int = 1, steps: int = 4000) -> float:
        b, rng, drafted = Backoff(threshold=threshold), random.Random(7), 0
        for _ in range(steps):
            if b.drafts_now("r"):
                drafted += 1
                a = 0
                while a < k and rng.random() < accept:
                    a += 1
                b.record("r", k, a)
        return drafted / steps

    assert drafting_share(0.7, 0.5) > 0.95 and drafting_share(0.7, 0.35, k=2) > 0.95
    assert drafting_share(0.4, 0.7) < 0.15 and drafting_share(0.43, 0.55) < 0.15
    assert drafting_share(0.3, 0.6, k=2) < 0.15


def test_backoff_threshold_is_the_measured_break_even():
    """The engine's measured step times set the back-off's threshold: (drafting step / plain step - 1) / k."""
    from edgeserve.engine.spec.backoff import StepCosts

    costs = StepCosts()
    assert costs.break_even(1, 2) is None  # nothing measured yet
    costs.record(1, False, 0.020)
    assert costs.break_even(1, 2) is None
    costs.record(1, True, 0.030)
    assert costs.break_even(1, 2) == pytest.approx(0.25)  # 1 + 2a tokens for 1.5x the time
    assert costs.break_even(4, 2) is None  # another batch size is measured apart
    for _ in range(40):
        costs.record(1, True, 0.040)  # the average follows the newest steps
    assert costs.break_even(1, 1) == pytest.approx(1.0, abs=1e-3)


def test_engine_measures_its_steps_and_backs_off_where_drafting_does_not_pay(files):
    """Inside the engine, decode steps are timed with and without drafts (prompt steps are not), and a request whose
    drafts are accepted less often than the measured break-even stops drafting."""
    _, _, _, q8 = files("qwen35-mtp")
    lm = load_ours(q8, dtype="bfloat16")
    ps = prompts(5, n=1)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = outputs(LLM.from_model(lm, kv_cache_gb=0.01, speculative="off"), ps, params)
    llm = LLM.from_model(lm, kv_cache_gb=0.01, speculative="mtp", num_speculative_tokens=1)
    spec = llm.engine.spec
    recorded, head_while_paused = [], []
    record = spec.record_step

    def spy(seqs, drafts, seconds):
        recorded.append((seqs, list(drafts)))
        if not drafts:  # a paused request's head holds nothing (it starts again when the pause ends)
            head_while_paused.extend(i for i in spec.mtp.seqs if spec.backoff.paused(i))
        record(seqs, drafts, seconds)

    spec.record_step = spy
    spec.costs.record(1, False, 0.010)  # as if measured: a drafting step costs 1.8x a plain one, so 0.8 is the bar
    spec.costs.record(1, True, 0.018)
    spec.costs.smoothing = 0.0  # and stays so (wall times on a shared machine vary)
    spec.mtp.oracle = ForcedOracle(ps, plain, lm.config.vocab_size, accept=0.3)  # below the bar
    out = outputs(llm, ps, params)
    assert out == plain
    assert recorded and all(seqs == 1 for seqs, _ in recorded)  # decode steps only: the prompt's step is not timed
    assert spec.backoff.threshold == pytest.approx(0.8)
    drafting = [bool(d) for _, d in recorded]
    assert drafting[0] and drafting.count(False) > drafting.count(True)  # it backed off
    assert not head_while_paused


@pytest.mark.parametrize("name", CASES)
def test_fused_head_gives_the_per_op_heads_logits(name, files):
    """The head's block as a one-layer plan on the fused native stack (Q8_0, bfloat16) gives the per-op block's
    logits, through a prompt chunk and single rows over its paged pool."""
    _, _, _, q8 = files(name)
    model = load_ours(q8, dtype="bfloat16").model
    assert model.native_decoder() is not None and head_decoder(model, model.mtp) is not None
    ids = IDS
    hidden = torch.randn(len(ids) - 1, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    chunks = [(0, 9), *((i, i + 1) for i in range(9, len(ids) - 1))]
    fused = head_logits(model, ids, hidden.to(model.dtype), chunks)
    model.mtp.native = None  # the per-op path
    per_op = head_logits(model, ids, hidden.to(model.dtype), chunks)
    assert per_op.abs().max() > 1.0
    assert torch.equal(fused, per_op)
