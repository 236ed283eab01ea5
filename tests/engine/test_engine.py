"""The engine on the real default model: batching, prefix cache, preemption and chunked prefill change
nothing in greedy outputs, and every block comes back."""

from __future__ import annotations

import pytest

from edgeserve.engine.config import EngineConfig
from edgeserve.errors import PromptTooLongError, QueueFullError
from edgeserve.llm import LLM
from edgeserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def chat_ids(lm, text: str) -> list[int]:
    return lm.tokenizer.encode(lm.chat_template.render([{"role": "user", "content": text}]), add_special_tokens=False)


def prompts(lm, n: int) -> list[list[int]]:
    """n prompts of clearly different lengths (about 30 to 200 tokens)."""
    topics = ["the sea", "a clock", "bread", "winter", "a violin", "rivers", "chess", "bees"]
    return [chat_ids(lm, f"Tell me about {topics[i % 8]}. " + "Please be detailed and precise. " * (i * 2))
            for i in range(n)]


def token_ids(results) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


def assert_pool_empty(llm: LLM) -> None:
    bm = llm.engine.scheduler.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks
    assert not llm.engine.has_work()


def test_16_prompts_batched_equal_each_alone(default_model):
    llm = LLM.from_model(default_model, kv_cache_gb=0.2, enable_prefix_caching=False)
    ps = prompts(default_model, 16)
    assert len({len(p) for p in ps}) == 16
    together = token_ids(llm.generate(ps, GREEDY))
    assert llm.engine.stats().num_steps < 16 * GREEDY.max_tokens  # they really ran together
    alone = [token_ids(llm.generate([p], GREEDY))[0] for p in ps]
    assert together == alone
    assert all(len(t) > 0 for t in together)
    assert_pool_empty(llm)


def test_results_come_back_in_prompt_order_with_text(default_model):
    llm = LLM.from_model(default_model, kv_cache_gb=0.05)
    texts = ["The capital of France is", "1, 2, 3, 4,"]
    results = llm.generate(texts, SamplingParams(temperature=0, max_tokens=8))
    assert [r.prompt for r in results] == texts
    for r in results:
        assert r.text == default_model.tokenizer.decode(r.outputs[0].token_ids)
        assert r.outputs[0].finish_reason == "length"
    assert results[1].text.strip().startswith("5")


def test_chat_applies_the_template(default_model):
    llm = LLM.from_model(default_model, kv_cache_gb=0.05)
    # a question whose greedy answer has no near-tie (every step's top two logprobs > 2 apart on the default and
    # float32 paths); "capital of France?" is not one: "L'Étoile" and "The capital..." tie on AVX2
    msgs = [{"role": "user", "content": "What is the capital of Japan?"}]
    params = SamplingParams(temperature=0, max_tokens=12)
    via_chat = llm.chat(msgs, params)[0]
    ids = chat_ids(default_model, msgs[0]["content"])
    assert via_chat.prompt_token_ids == ids
    assert via_chat.outputs[0].token_ids == llm.generate([ids], params)[0].outputs[0].token_ids
    assert "Tokyo" in via_chat.text


def test_shared_prefix_computes_only_the_suffix(default_model):
    lm = default_model
    system = "You are a meticulous assistant. " + "Answer carefully, cite sources and check every step. " * 20
    first = chat_ids(lm, system + "Question one: what is rain?")
    second = chat_ids(lm, system + "Question two: why is the sky blue?")
    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert common > 200
    llm = LLM.from_model(lm, kv_cache_gb=0.1)
    llm.generate([first], GREEDY)
    bm = llm.engine.scheduler.block_manager
    computed_before = bm.num_prompt_tokens_computed
    with_cache = llm.generate([second], GREEDY)[0]
    reused = common  # whole blocks, then the shared start of the block where the prompts part (from a copy)
    assert with_cache.num_cached_tokens == reused
    assert bm.num_prompt_tokens_computed - computed_before == len(second) - reused
    no_cache = LLM.from_model(lm, kv_cache_gb=0.1, enable_prefix_caching=False)
    assert no_cache.generate([second], GREEDY)[0].outputs[0].token_ids == with_cache.outputs[0].token_ids
    assert no_cache.engine.scheduler.block_manager.num_prompt_tokens_reused == 0


def test_same_prompt_again_computes_only_its_last_token(default_model):
    ids = chat_ids(default_model, "Write one sentence about the sea. " * 6)
    assert len(ids) % 16 > 1  # the prompt ends inside a block
    llm = LLM.from_model(default_model, kv_cache_gb=0.1)
    first = llm.generate([ids], SamplingParams(temperature=0, max_tokens=3))[0]
    again = llm.generate([ids], SamplingParams(temperature=0, max_tokens=3))[0]
    assert again.num_cached_tokens == len(ids) - 1
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    llm.engine.scheduler.block_manager.check_integrity()


def test_multi_turn_reuses_the_previous_turn(default_model):
    lm = default_model
    llm = LLM.from_model(lm, kv_cache_gb=0.1)
    turn = [{"role": "user", "content": "Name a large animal. " * 8}]
    reply = llm.chat(turn, GREEDY)[0]
    follow = turn + [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "And a small one?"}]
    second = llm.chat(follow, GREEDY)[0]
    # everything of the first prompt that filled whole blocks comes from the cache
    assert second.num_cached_tokens >= (len(reply.prompt_token_ids) // 16) * 16 > 0


def test_preemption_keeps_outputs_identical_and_returns_every_block(default_model):
    ps = prompts(default_model, 6)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    roomy = LLM.from_model(default_model, kv_cache_gb=0.2)
    expected = token_ids(roomy.generate(ps, params))
    # Room for the longest request alone, far from all six at once.
    longest = max(len(p) for p in ps) + params.max_tokens
    per_block = 2 * 30 * 3 * 64 * 2 * 16  # bytes: K and V, 30 layers, 3 KV heads of 64, bf16, 16 tokens
    tight = LLM.from_model(default_model, kv_cache_gb=((longest // 16) + 3) * per_block / 2**30)
    assert tight.engine.scheduler.block_manager.num_blocks < sum(len(p) + 24 for p in ps) // 16
    got = token_ids(tight.generate(ps, params))
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert_pool_empty(tight)


def test_chunked_prefill_matches_unchunked(default_model):
    long_prompt = chat_ids(default_model, "Summarize this. " + "The quick brown fox jumps over the lazy dog. " * 30)
    assert len(long_prompt) > 300
    whole = LLM.from_model(default_model, kv_cache_gb=0.1, max_num_batched_tokens=1024, enable_prefix_caching=False)
    chunked = LLM.from_model(default_model, kv_cache_gb=0.1, max_num_batched_tokens=64, enable_prefix_caching=False)
    a = whole.generate([long_prompt], GREEDY)[0].outputs[0].token_ids
    b = chunked.generate([long_prompt], GREEDY)[0].outputs[0].token_ids
    assert a == b
    assert chunked.engine.stats().num_steps >= len(long_prompt) // 64 + GREEDY.max_tokens - 1
    assert whole.engine.stats().num_steps <= GREEDY.max_tokens


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(default_model):
    llm = LLM.from_model(default_model, kv_cache_gb=0.1)
    p = chat_ids(default_model, "Write a poem about autumn.")
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=20)
    alone1 = token_ids(llm.generate([p], seeded))[0]
    alone2 = token_ids(llm.generate([p], seeded))[0]
    assert alone1 == alone2
    others = [SamplingParams(temperature=1.0, max_tokens=20), GREEDY]
    batch = llm.generate([p, p, p], [others[0], seeded, others[1]])
    assert batch[1].outputs[0].token_ids == alone1
    other_seed = token_ids(llm.generate([p], SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=20)))[0]
    assert other_seed != alone1


def test_stop_strings_and_stop_tokens_end_the_text(default_model):
    llm = LLM.from_model(default_model, kv_cache_gb=0.05)
    p = default_model.tokenizer.encode("1, 2, 3, 4,")
    free = llm.generate([p], SamplingParams(temperature=0, max_tokens=16))[0]
    assert " 7" in free.text
    cut = llm.generate([p], SamplingParams(temperature=0, max_tokens=16, stop=[" 7"]))[0]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == " 7"
    assert cut.text == free.text[: free.text.index(" 7")]
    # a token id can end it too; its text is not shown
    first = free.outputs[0].token_ids[0]
    by_id = llm.generate([p], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[first]))[0]
    assert by_id.outputs[0].token_ids == [first] and by_id.text == ""
    assert by_id.outputs[0].finish_reason == "stop" and by_id.outputs[0].stop_reason == first
    assert_pool_empty(llm)


def test_logit_bias_bans_and_forces_tokens(default_model):
    llm = LLM.from_model(default_model, kv_cache_gb=0.05)
    p = default_model.tokenizer.encode("1, 2, 3, 4,")
    free = llm.generate([p], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids
    banned = llm.generate([p], SamplingParams(temperature=0, max_tokens=4, logit_bias={free[0]: -100}))[0]
    assert banned.outputs[0].token_ids[0] != free[0]
    forced = llm.generate([p], SamplingParams(temperature=0.8, seed=1, max_tokens=4, logit_bias={42: 100}))[0]
    assert forced.outputs[0].token_ids == [42] * 4
    with pytest.raises(ValueError, match="logit_bias token ids"):
        llm.engine.add_request(p, SamplingParams(logit_bias={10**7: 1.0}))
    assert_pool_empty(llm)


def test_bad_requests_are_refused_up_front(default_model):
    llm = LLM.from_model(default_model, kv_cache_gb=0.05, max_model_len=64, max_waiting=2)
    with pytest.raises(PromptTooLongError, match="70 tokens.*64"):
        llm.engine.add_request(list(range(70)), GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        llm.engine.add_request([10**9], GREEDY)
    llm.engine.add_request([1, 2, 3], GREEDY)
    llm.engine.add_request([1, 2, 3], GREEDY)
    with pytest.raises(QueueFullError):
        llm.engine.add_request([1, 2, 3], GREEDY)
    while llm.engine.has_work():
        llm.engine.step()
    assert_pool_empty(llm)


def test_max_tokens_is_capped_by_the_context(default_model):
    llm = LLM.from_model(default_model, kv_cache_gb=0.05, max_model_len=40)
    p = default_model.tokenizer.encode("Once upon a time, " * 4)
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 40 - len(p)
    assert out.outputs[0].finish_reason == "length"


def test_a_request_ends_once_whichever_ways_it_is_ended(default_model):
    """A request that ends by length while an abort for it waits, and is then ended again directly, is counted
    and freed once; the outputs say it ended once."""
    llm = LLM.from_model(default_model, kv_cache_gb=0.05)
    eng = llm.engine
    rid = eng.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    finished_before = eng.num_requests_finished
    req = eng._pending_add[0]
    ends = [o for o in eng.step() if o is not None and o.finished]
    req_gone = rid not in eng.requests
    eng.finish_request(rid)  # an abort for a request that already ended
    ends += [o for o in eng.step() if o is not None and o.finished]
    eng._end(req, "abort")  # the one ending, called again (a failure after a stop, say): nothing happens
    assert req_gone and [o.request_id for o in ends] == [rid]
    assert eng.num_requests_finished == finished_before + 1
    assert_pool_empty(llm)


def test_engine_config_rejects_bad_values():
    for bad in [dict(max_num_seqs=0), dict(block_size=-1), dict(kv_cache_gb=0), dict(max_model_len=1)]:
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig(**bad)
