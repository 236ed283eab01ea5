"""Prompt tokens through the dense copy of CPU int4 weights: routing, tile invariance, load policy, engine use."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edgeserve.kernels.formats.quant_linear import PROMPT_TILE, Int4Weight, PromptRows, Q4Blocks, linear
from edgeserve.models.config import ModelConfig
from edgeserve.models.load import dense_prefill_bytes, want_dense_prefill

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                                reason="torch has no CPU int4 matmul")


def _weight(out_f: int = 128, in_f: int = 96, keep_dense: bool = True) -> tuple[Int4Weight, Q4Blocks]:
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (out_f, in_f), generator=g, dtype=torch.uint8)
    scale = torch.rand(out_f, in_f // 32, generator=g) * 0.02
    offset = -torch.rand(out_f, in_f // 32, generator=g) * 0.1
    blocks = Q4Blocks(q, scale, offset, 32)
    return Int4Weight(blocks, torch.bfloat16, keep_dense=keep_dense), blocks


def test_prompt_rows_take_the_dense_copy_and_the_others_the_int4_kernel():
    w, blocks = _weight()
    assert torch.equal(w.dense, blocks.dequantize().to(torch.bfloat16))
    x = torch.randn(10, 96, dtype=torch.bfloat16)
    is_prompt = [False, False, True, True, True, False, True, True, True, True]
    rows = PromptRows.build(is_prompt)
    y = linear(x, w, prompt_rows=rows)
    prompt = torch.tensor(is_prompt)
    assert torch.equal(y[~prompt], w.matmul(x[~prompt]))
    tile = torch.zeros(PROMPT_TILE, 96, dtype=torch.bfloat16)
    tile[: int(prompt.sum())] = x[prompt]
    assert torch.equal(y[prompt], F.linear(tile, w.dense)[: int(prompt.sum())])
    # and both agree with the float weight up to bf16 rounding
    ref = x.float() @ blocks.dequantize().t()
    assert torch.allclose(y.float(), ref, atol=0.05, rtol=0.02)


def test_a_prompt_row_does_not_depend_on_the_other_rows():
    w, _ = _weight(out_f=256, in_f=192)
    x = torch.randn(150, 192, dtype=torch.bfloat16)
    alone = linear(x[:3], w, prompt_rows=PromptRows.build([True] * 3))
    many = linear(x, w, prompt_rows=PromptRows.build([True] * 150))
    mixed = linear(torch.cat([x[100:104], x[:3]]), w, prompt_rows=PromptRows.build([False] * 4 + [True] * 3))
    assert torch.equal(alone, many[:3]) and torch.equal(alone, mixed[4:])


def test_no_prompt_rows_means_no_split_and_no_copy_means_int4():
    assert PromptRows.build([False, False]) is None
    w, _ = _weight(keep_dense=False)
    assert w.dense is None
    x = torch.randn(5, 96, dtype=torch.bfloat16)
    assert torch.equal(linear(x, w, prompt_rows=PromptRows.build([True] * 5)), w.matmul(x))


def _config() -> ModelConfig:
    from edgeserve.models.config import config_from_hf

    return config_from_hf({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 64,
                           "rms_norm_eps": 1e-5})


def test_load_policy():
    c = _config()
    per_layer = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128
    assert dense_prefill_bytes(c, torch.bfloat16) == 2 * per_layer * 2
    cpu = torch.device("cpu")
    assert want_dense_prefill("on", c, torch.bfloat16, cpu) and not want_dense_prefill("off", c, torch.bfloat16, cpu)
    assert want_dense_prefill("auto", c, torch.bfloat16, cpu)  # a few hundred KB always fit
    assert not want_dense_prefill("auto", c, torch.bfloat16, torch.device("meta"))  # only CPUs
    with pytest.raises(ValueError, match="dense_prefill"):
        want_dense_prefill("yes", c, torch.bfloat16, cpu)


def test_the_default_model_runs_prompts_through_dense_copies(default_model):
    from edgeserve.llm import LLM
    from edgeserve.sampling_params import SamplingParams

    layer = default_model.model.layers[0]
    if not isinstance(layer.gate_up, Int4Weight):
        pytest.skip("the default model runs on the native CPU kernels here (or torch has no fast CPU int4 path)")
    assert layer.gate_up.dense is not None and layer.gate_up.dense.dtype == torch.bfloat16
    # the prompt's first sampled token equals the one from int4-only prompt processing up to near-ties: compare
    # the greedy first token on a few prompts against the same weights without the dense copies
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    packed_only = load_model(resolve(str(default_model.source.path)), dense_prefill="off")
    assert packed_only.model.layers[0].gate_up.dense is None
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
    ids = [default_model.tokenizer.encode(p) for p in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=1)
    a = [r.outputs[0].token_ids for r in LLM.from_model(default_model, kv_cache_gb=0.05).generate(ids, greedy)]
    b = [r.outputs[0].token_ids for r in LLM.from_model(packed_only, kv_cache_gb=0.05).generate(ids, greedy)]
    assert a == b
