"""Greedy outputs over contexts deeper than one key segment of the native attention (kernels/cpu/src/attention.c splits
a row's keys at every 512 positions and combines the segments): the same tokens whatever the prompt's chunking and
whatever else is batched with it, on a tiny random model through the engine."""

from __future__ import annotations

import pytest
from tiny_gguf import write_tiny_llama

from edgeserve import LLM, SamplingParams
from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.models.load import load_model
from edgeserve.registry import resolve

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no native CPU kernels here")


@pytest.fixture(scope="module")
def deep_lm(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("deep") / "t.gguf", hidden=64, heads=4, kv_heads=2, ffn=128,
                            context=2048)
    return load_model(resolve(str(path)))


def test_deep_prompt_gives_the_same_tokens_chunked_batched_and_whole(deep_lm):
    long_prompt = [3 + (i * 37 + i // 7) % 250 for i in range(1300)]  # past 2 segment boundaries
    others = [[3 + (i * 11 + j) % 250 for j in range(n)] for i, n in enumerate((40, 700))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(batched_tokens: int, prompts: list[list[int]]) -> list[list[int]]:
        llm = LLM.from_model(deep_lm, kv_cache_gb=0.02, max_num_batched_tokens=batched_tokens,
                             enable_prefix_caching=False)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    whole = run(2048, [long_prompt])[0]
    assert len(whole) == 8
    assert run(96, [long_prompt])[0] == whole  # chunks of 96 that straddle 512 and 1,024
    batched = run(160, [others[0], long_prompt, others[1]])
    assert batched[1] == whole
    assert batched[2] == run(2048, [others[1]])[0]
