"""Engine checks a model test runs on its tiny GGUF: greedy outputs that depend neither on batching nor on chunking."""

from __future__ import annotations


def assert_batch_and_chunk_invariant(llm, prompts: list[list[int]], max_tokens: int = 8) -> None:
    """Greedy outputs of `prompts` the same generated together or alone, and the longest (the last) the same again
    with its prompt run in 16-token chunks (which takes that many more steps)."""
    from edgeserve.llm import LLM
    from edgeserve.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    together = [r.outputs[0].token_ids for r in llm.generate(prompts, greedy)]
    alone = [llm.generate([p], greedy)[0].outputs[0].token_ids for p in prompts]
    assert together == alone and all(len(t) == max_tokens for t in together)
    chunked = LLM.from_model(llm.lm, kv_cache_gb=0.01, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert chunked.generate([prompts[-1]], greedy)[0].outputs[0].token_ids == alone[-1]
    assert chunked.engine.stats().num_steps >= len(prompts[-1]) // 16 + max_tokens - 1


def drive(engine, prompts: list[list[int]], params, concurrent: bool = False):
    """Run `prompts` through an EngineCore with `params` (one after another, or all added at once), request ids
    r0, r1, ...; return ({id: generated ids}, {id: cached prompt tokens})."""
    outs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}

    def drain():
        while engine.has_work():
            for o in engine.step():
                outs.setdefault(o.request_id, []).extend(o.token_ids)
                cached[o.request_id] = o.num_cached_tokens
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"r{i}")
        if not concurrent:
            drain()
    drain()
    return outs, cached
