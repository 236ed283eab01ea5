"""Speculative decoding inside the engine: greedy output is token-for-token the plain engine's (prompt lookup and
draft model, alone and batched, through stop tokens, stop strings and max_tokens), rejected drafts' blocks come
back, the draft must share the target's tokenizer, metrics count."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_gguf import write_tiny_llama

from edgeserve.engine.config import EngineConfig
from edgeserve.engine.core import _cut
from edgeserve.engine.spec import DraftMismatchError
from edgeserve.llm import LLM
from edgeserve.models.load import load_model
from edgeserve.registry import resolve
from edgeserve.sampling_params import SamplingParams


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def ids(results) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


def assert_pool_empty(llm: LLM) -> None:
    for bm in filter(None, [llm.engine.scheduler.block_manager,
                            getattr(llm.engine.spec.draft, "block_manager", None) if llm.engine.spec else None]):
        bm.check_integrity()
        assert bm.num_free_blocks == bm.num_blocks


# --- tiny random models: a float32 target and its own Q8_0 copy as the draft ---------------------------------

@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spec")
    shape = dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, seed=3)
    target = load_model(resolve(str(write_tiny_llama(folder / "t.gguf", **shape))), dtype="float32")
    draft = load_model(resolve(str(write_tiny_llama(folder / "d.gguf", qtype="Q8_0", **shape))), dtype="float32")
    return target, draft


def tiny_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 262) for _ in range(rng.randrange(4, 30))] for _ in range(n)]


def test_draft_greedy_equals_plain_alone_and_batched(tiny_pair):
    target, draft = tiny_pair
    ps = tiny_prompts(6)
    params = greedy(40, ignore_eos=True)
    plain = LLM.from_model(target, kv_cache_gb=0.01)
    spec = LLM.from_model(target, kv_cache_gb=0.01, speculative="draft", num_speculative_tokens=4, draft=draft)
    expected = ids(plain.generate(ps, params))
    assert ids(spec.generate(ps, params)) == expected
    stats = spec.engine.stats()
    assert stats.spec_accepted_tokens > stats.spec_proposed_tokens // 2  # the Q8_0 copy agrees mostly ...
    assert stats.spec_accepted_tokens < stats.spec_proposed_tokens  # ... not always: rejections were rolled back
    assert stats.num_steps < 40 * len(ps) / 2
    assert ids(spec.generate(ps[:1], params)) == expected[:1]
    assert_pool_empty(spec)


def test_draft_max_tokens_and_stop_tokens_inside_an_accepted_run(tiny_pair):
    target, draft = tiny_pair
    p = tiny_prompts(1, seed=5)[0]
    plain = LLM.from_model(target, kv_cache_gb=0.01)
    spec = LLM.from_model(target, kv_cache_gb=0.01, speculative="draft", num_speculative_tokens=5, draft=draft)
    full = ids(plain.generate([p], greedy(16, ignore_eos=True)))[0]
    for n in range(1, 13):  # every cut point, most of them inside a run of accepted drafts
        got = spec.generate([p], greedy(n, ignore_eos=True))[0].outputs[0]
        assert got.token_ids == full[:n] and got.finish_reason == "length"
    for i in (3, 6, 9):
        stop = full[i]
        first = full.index(stop)
        got = spec.generate([p], greedy(16, ignore_eos=True, stop_token_ids=[stop]))[0].outputs[0]
        assert got.token_ids == full[: first + 1]
        assert got.finish_reason == "stop" and got.stop_reason == stop
    assert spec.engine.stats().spec_mean_accepted_length > 2
    assert_pool_empty(spec)


def test_rollback_keeps_exactly_the_accepted_tokens_blocks(tiny_pair):
    target, draft = tiny_pair
    for method in ("draft", "ngram"):
        llm = LLM.from_model(target, kv_cache_gb=0.01, speculative=method, num_speculative_tokens=6,
                             enable_prefix_caching=False, block_size=4, draft=draft if method == "draft" else None)
        core = llm.engine
        bm = core.scheduler.block_manager
        # repetitive prompts, so prompt lookup proposes (and is mostly rejected by the random model)
        ps = [(q * 4)[:40] for q in tiny_prompts(5, seed=7)]
        for p in ps:
            core.add_request(p, greedy(30, ignore_eos=True))
        while core.has_work():
            core.step()
            bm.check_integrity()
            running = core.scheduler.running
            need = sum(bm.blocks_needed(max(s.num_computed_tokens, len(s.prompt_token_ids))) for s in running)
            assert bm.num_blocks - bm.num_free_blocks == need
            if method == "draft":
                dbm = core.spec.draft.block_manager
                dbm.check_integrity()
                for s in running:
                    c = core.spec.draft.computed.get(s.seq_id, 0)
                    assert c <= s.num_computed_tokens
                    assert len(dbm.block_table(s.seq_id)) == dbm.blocks_needed(c) if c else True
        stats = core.stats()
        assert stats.spec_proposed_tokens > stats.spec_accepted_tokens  # there were rejections to roll back
        assert_pool_empty(llm)


def test_ngram_mixed_batch_with_opt_out_and_sampling(tiny_pair):
    target, _ = tiny_pair
    ps = [(q * 3)[:36] for q in tiny_prompts(4, seed=11)]
    params = [greedy(24, ignore_eos=True), greedy(24, ignore_eos=True, speculative=False),
              SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=24, ignore_eos=True),
              greedy(24, ignore_eos=True, repetition_penalty=1.3)]
    plain = LLM.from_model(target, kv_cache_gb=0.01)
    spec = LLM.from_model(target, kv_cache_gb=0.01, speculative="ngram")
    expected = ids(plain.generate(ps, params))
    got = ids(spec.generate(ps, params))
    for i in (0, 1, 3):
        assert got[i] == expected[i]
    assert len(got[2]) == 24
    assert spec.engine.stats().spec_proposed_tokens > 0
    # a batch that opts out entirely never proposes
    off = LLM.from_model(target, kv_cache_gb=0.01, speculative="ngram")
    assert ids(off.generate(ps, greedy(24, ignore_eos=True, speculative=False))) == ids(
        plain.generate(ps, greedy(24, ignore_eos=True)))
    assert off.engine.stats().spec_proposed_tokens == 0
    assert_pool_empty(spec)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_speculation_with_overlap_equals_plain_greedy(tiny_pair, method, monkeypatch):
    """Speculation and the one-step overlap together: greedy output is token for token the plain engine's, drafts
    were verified, and the rows of requests that do not speculate were launched before the previous step landed."""
    from edgeserve.engine.runner import model_runner

    fills = []
    original = model_runner.TokenFill.apply
    monkeypatch.setattr(model_runner.TokenFill, "apply", lambda self, t: (fills.append(len(self.index)), original(self, t)))
    target, draft = tiny_pair
    ps = [(q * 3)[:36] for q in tiny_prompts(6, seed=13)]
    params = [greedy(30, ignore_eos=True, speculative=i % 2 == 0) for i in range(len(ps))]
    expected = ids(LLM.from_model(target, kv_cache_gb=0.01).generate(ps, params))
    spec = LLM.from_model(target, kv_cache_gb=0.01, speculative=method, overlap="on",
                          draft=draft if method == "draft" else None)
    assert spec.engine.overlap
    assert ids(spec.generate(ps, params)) == expected
    assert ids(spec.generate(ps[:1], params[:1])) == expected[:1]
    stats = spec.engine.stats()
    assert stats.spec_verifications > 0
    # a draft model always proposes, so the opted-out rows overlap; prompt lookup rarely matches the random model's
    # output, and a speculating request's one-token row is applied before the next launch (it proposes from it)
    assert (stats.spec_accepted_tokens > 0 and sum(fills) > 0) or method == "ngram"
    assert_pool_empty(spec)
    assert spec.engine._inflight is None


def test_cut_stops_at_the_first_stop_token_or_max_tokens():
    assert _cut([5, 6, 7, 8], frozenset({7}), room=10) == (3, "stop")
    assert _cut([5, 6, 7, 8], frozenset(), room=2) == (2, "length")
    assert _cut([5, 6], frozenset({6}), room=2) == (2, "stop")  # a stop token wins over length
    assert _cut([5, 6], frozenset(), room=5) == (2, None)


def test_config_flags_and_bad_values():
    from edgeserve.cli import build_parser, engine_config_from_args
    from edgeserve.errors import EdgeserveError

    args = build_parser().parse_args(["run", "hi", "--speculative", "draft", "--draft-model", "x.gguf",
                                      "--num-speculative-tokens", "3"])
    config = engine_config_from_args(args)
    assert (config.speculative, config.draft_model, config.num_speculative_tokens) == ("draft", "x.gguf", 3)
    default = engine_config_from_args(build_parser().parse_args(["run", "hi"]))
    assert (default.speculative, default.num_speculative_tokens) == ("auto", None)  # mtp where the file has a head
    alias = engine_config_from_args(build_parser().parse_args(["run", "hi", "--speculative", "mtp",
                                                               "--spec-tokens", "3"]))
    assert (alias.speculative, alias.num_speculative_tokens) == ("mtp", 3)
    off = engine_config_from_args(build_parser().parse_args(["run", "hi", "--speculative", "off"]))
    assert off.speculative == "off"
    with pytest.raises(EdgeserveError, match="--num-speculative-tokens"):
        engine_config_from_args(build_parser().parse_args(["run", "hi", "--num-speculative-tokens", "0"]))
    assert default.spec_draft_vocab is None  # the measured default (spec.DEFAULT_DRAFT_VOCAB)
    cut = engine_config_from_args(build_parser().parse_args(["run", "hi", "--spec-draft-vocab", "0"]))
    assert cut.spec_draft_vocab == 0
    with pytest.raises(EdgeserveError, match="--spec-draft-vocab"):
        engine_config_from_args(build_parser().parse_args(["run", "hi", "--spec-draft-vocab", "-5"]))
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(speculative="medusa")


# --- the real default model -------------------------------------------------------------------------------------

def chat_ids(lm, text: str) -> list[int]:
    return lm.tokenizer.encode(lm.chat_template.render([{"role": "user", "content": text}]), add_special_tokens=False)


COPY = ("Repeat this sentence exactly, twice: The old lighthouse keeper climbed the spiral stairs every "
        "evening to light the lamp.")


def test_draft_with_another_tokenizer_is_refused(default_model, tiny_pair):
    target, _ = tiny_pair
    with pytest.raises(DraftMismatchError, match="tokenizer differs"):
        LLM.from_model(default_model, kv_cache_gb=0.01, speculative="draft", draft=target)
    with pytest.raises(ValueError, match="needs a draft model"):
        LLM.from_model(default_model, kv_cache_gb=0.01, speculative="draft")


def test_ngram_greedy_equals_plain_on_the_default_model(default_model):
    lm = default_model
    ps = [chat_ids(lm, COPY), chat_ids(lm, "Tell me about bees."), lm.tokenizer.encode("1, 2, 3, 4, 5,")]
    params = greedy(24)
    plain = LLM.from_model(lm, kv_cache_gb=0.05)
    spec = LLM.from_model(lm, kv_cache_gb=0.05, speculative="ngram")
    expected = ids(plain.generate(ps, params))
    assert ids(spec.generate(ps, params)) == expected  # batched
    assert [ids(spec.generate([p], params))[0] for p in ps] == expected  # alone
    stats = spec.engine.stats()
    assert stats.spec_accepted_tokens > 10 and stats.spec_mean_accepted_length > 1.5
    # max_tokens and a stop string that fall inside accepted runs of the copy prompt
    copy_text = plain.generate([ps[0]], params)[0].text
    stop = copy_text.split()[6]
    for kw in (dict(max_tokens=9), dict(max_tokens=14), dict(stop=[stop])):
        a = plain.generate([ps[0]], SamplingParams(temperature=0.0, **{"max_tokens": 24, **kw}))[0]
        b = spec.generate([ps[0]], SamplingParams(temperature=0.0, **{"max_tokens": 24, **kw}))[0]
        assert (b.text, b.outputs[0].token_ids, b.outputs[0].finish_reason, b.outputs[0].stop_reason) == (
            a.text, a.outputs[0].token_ids, a.outputs[0].finish_reason, a.outputs[0].stop_reason)
    assert_pool_empty(spec)


def test_int4_draft_for_the_float32_target_end_to_end(default_model, default_model_fp32):
    lm = default_model_fp32
    ps = [chat_ids(lm, COPY), chat_ids(lm, "What is the capital of France?")]
    params = greedy(20)
    plain = LLM.from_model(lm, kv_cache_gb=0.05)
    spec = LLM.from_model(lm, kv_cache_gb=0.05, speculative="draft", num_speculative_tokens=4, draft=default_model)
    assert ids(spec.generate(ps, params)) == ids(plain.generate(ps, params))
    stats = spec.engine.stats()
    assert stats.spec_acceptance_rate > 0.5  # the int4 sibling mostly agrees with its float32 self
    assert stats.num_steps < len(ps) * 20
    # sampling with the pair gives well-formed, reproducible output
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12)
    first = ids(spec.generate(ps[:1], sampled))[0]
    assert len(first) >= 1 and first == ids(spec.generate(ps[:1], sampled))[0]
    assert_pool_empty(spec)
