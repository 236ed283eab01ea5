"""Issue 33's variants in the fused native CPU stack (kernels/cpu/src/layer.c): on a Q8_0 GGUF at bfloat16, SmolLM3 (its
NoPE layers rotating by identity tables), Ministral 3 (below its attention-temperature length) and Qwen3-VL's text
model run as one native call per step and give the per-op path's hidden states and K/V pool bit for bit; Granite's
residual multiplier and OLMo's block are not in the stack, which declines them for the per-op path."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.cpu.decoder import NativeDecoder
from edgeserve.loaders.gguf_file import GGUFFile
from edgeserve.loaders.gguf_weights import GGUFWeights
from edgeserve.models.config import config_from_gguf
from edgeserve.models.decoders import decoder_class

pytest.importorskip("transformers")
from test_cpu_decoder import STEPS, _native_on, run_steps  # noqa: E402,F401  (the fixture keeps the kernels on)
from test_more_archs import paged_logits  # noqa: E402
from test_variant_archs import hf_model, reference_logits, write_gguf  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no native CPU kernels here")


def q8_model(case: str, path: Path):
    """`case` as a Q8_0 GGUF, loaded at the CPU serving dtype."""
    g = GGUFFile(write_gguf(hf_model(case), case, path, q8_0=True))
    config = config_from_gguf(g.metadata, set(g.tensor_names()))
    return decoder_class(config).from_weights(config, GGUFWeights(g, config.num_heads, config.num_kv_heads),
                                              dtype=torch.bfloat16)


def assert_same(fused, per_op) -> None:
    for step, (a, b) in enumerate(zip(fused[0], per_op[0])):
        assert torch.equal(a, b), f"step {step}: max diff {(a.float() - b.float()).abs().max().item()}"
    assert torch.equal(fused[1].k, per_op[1].k) and torch.equal(fused[1].v, per_op[1].v)


@pytest.mark.parametrize("case", ["smollm3", "qwen3vl"])
def test_fused_stack_equals_the_per_op_path(case: str, tmp_path: Path) -> None:
    model = q8_model(case, tmp_path / "m.gguf")
    assert isinstance(model.native_decoder(), NativeDecoder)
    assert_same(run_steps(model, True, STEPS), run_steps(model, False, STEPS))


def test_smollm3_nope_layers_matter_in_the_fused_stack(tmp_path: Path) -> None:
    model = q8_model("smollm3", tmp_path / "m.gguf")
    fused, _ = run_steps(model, True, STEPS[:2])
    model.config = dataclasses.replace(model.config, rope_layers=None)  # RoPE everywhere
    roped, _ = run_steps(model, True, STEPS[:2])
    assert not torch.equal(fused[1], roped[1])


def test_ministral3_fused_below_its_temperature_length_per_op_past_it(tmp_path: Path) -> None:
    model = q8_model("mistral3", tmp_path / "m.gguf")
    short = model.config  # a temperature length of 4: every step below reaches past it
    model.config = dataclasses.replace(short, attn_temperature_length=64)  # STEPS stay below 64 positions
    assert isinstance(model.native_decoder(), NativeDecoder)
    assert_same(run_steps(model, True, STEPS), run_steps(model, False, STEPS))
    model.config = short
    assert_same(run_steps(model, True, STEPS), run_steps(model, False, STEPS))


@pytest.mark.parametrize("case", ["granite", "olmo3"])
def test_blocks_the_stack_does_not_take_keep_the_per_op_path(case: str, tmp_path: Path) -> None:
    """Declined by the stack, they run per op on the native matmuls and still follow transformers' logits."""
    model = q8_model(case, tmp_path / "m.gguf")
    assert model.native_decoder() is None
    got = paged_logits(model).float()
    ref = reference_logits(hf_model(case))
    assert torch.nn.functional.cosine_similarity(got, ref, dim=-1).min() > 0.99
