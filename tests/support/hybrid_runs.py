"""Speculation checks shared by the engine tests of models with recurrent state (Qwen3.5, LFM2, Nemotron-H,
Granite 4 H): an n-gram proposer that knows the greedy continuation, and the check that speculation with some drafts
rejected gives plain decoding's outputs (the states roll back)."""

from __future__ import annotations

from edgeserve.llm import LLM


class OracleProposer:
    """Proposes each prompt's known greedy continuation, every other proposal with its last draft wrong: so drafts
    are accepted whole, in part and not at all (a random tiny model rarely repeats its prompt for prompt lookup)."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]], vocab: int) -> None:
        self.runs = list(zip(prompts, outputs))
        self.vocab = vocab
        self.calls = 0

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        for prompt, out in self.runs:
            if token_ids[:len(prompt)] == prompt and token_ids[len(prompt):] == out[:len(token_ids) - len(prompt)]:
                drafts = out[len(token_ids) - len(prompt):][:k]
                self.calls += 1
                if drafts and self.calls % 2:
                    drafts[-1] = (drafts[-1] + 1) % self.vocab
                if drafts and self.calls % 3 == 0:
                    drafts[0] = (drafts[0] + 1) % self.vocab
                return drafts
        return []


def assert_speculation_keeps_outputs(lm, ps: list[list[int]], plain: list[list[int]], params,
                                     prefix_caching: bool) -> LLM:
    """n-gram speculation (3 tokens, the oracle's drafts) over `lm` gives `ps` their plain outputs `plain` under
    `params`, with drafts both accepted and rejected; the speculating LLM is returned for more checks."""
    spec = LLM.from_model(lm, kv_cache_gb=0.01, speculative="ngram", num_speculative_tokens=3,
                          enable_prefix_caching=prefix_caching)
    spec.engine.spec.ngram = OracleProposer(ps, plain, lm.config.vocab_size)
    assert [r.outputs[0].token_ids for r in spec.generate(ps, params)] == plain
    stats = spec.engine.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens
    return spec
