"""The default compute dtype follows the file (issue 54, edgeserve.models.dtype_policy): a file whose layer matrices
are stored F32 is served at float32 (transformers' logits to float32 noise, where bf16 rounding of its weights moved
them 0.15-0.56 nats on the big-MoE shapes), an F16 one at float32 on a CPU when it fits, BF16 and quantized files
at bf16 as before; an explicit --dtype wins. Files: tiny checkpoints converted by llama.cpp's convert_hf_to_gguf.py
(tests/converter_fixtures.py)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from converter_parity import load_ours, max_logprob_diff, our_logits, reference_logits  # noqa: E402
from dequantized_reference import dequantized_reference  # noqa: E402

from edgeserve.device import resolve_device  # noqa: E402
from edgeserve.models import dtype_policy  # noqa: E402
from edgeserve.registry.resolve import resolve  # noqa: E402

# float32 noise: tests/models/test_registered_architectures.py's bound (measured at most 4.8e-5 on these cases)
F32_BOUND = 2e-4
# what bf16 compute gives on these tiny f32 files (max |logprob diff| over the vocabulary: measured 0.05-0.6),
# far above F32_BOUND: the policy reverted fails the float32-noise assert below
CASES = ["qwen3", "qwen35"]


@pytest.mark.parametrize("name", CASES)
def test_f32_file_served_at_the_default_dtype_is_transformers_to_float32_noise(name, checkpoints, reference) -> None:
    _, _, gguf = checkpoints(name)
    served = load_ours(gguf, dtype="auto")
    assert served.model.dtype == torch.float32
    diff = max_logprob_diff(our_logits(served.model), reference(name))
    print(f"{name} f32 GGUF at dtype auto: max |logprob diff| {diff:.2e}")
    assert diff < F32_BOUND
    rounded = load_ours(gguf, dtype="bfloat16")  # an explicit --dtype still rounds the file's weights
    assert rounded.model.dtype == torch.bfloat16
    assert max_logprob_diff(our_logits(rounded.model), reference(name)) > 10 * F32_BOUND


def test_f32_hf_folder_is_served_at_float32(checkpoints, reference) -> None:
    _, folder, _ = checkpoints("qwen3")
    served = load_ours(folder, dtype="auto")
    assert served.model.dtype == torch.float32
    assert max_logprob_diff(our_logits(served.model), reference("qwen3")) < F32_BOUND


@pytest.mark.parametrize("outtype", ["bf16", "q8_0"])
def test_bf16_and_q8_0_files_keep_the_bf16_default(outtype, checkpoints) -> None:
    _, _, gguf = checkpoints("qwen3", outtype=outtype)
    assert dtype_policy.stored_matrix_type(resolve(str(gguf), pull_missing=False)) == outtype.upper()
    assert load_ours(gguf, dtype="auto").model.dtype == torch.bfloat16


def test_f16_file_on_a_cpu_is_float32_when_it_fits_else_bf16(checkpoints, monkeypatch) -> None:
    """An F16 file keeps every bit at float32 (transformers on the file's F16 values to float32 noise); when twice
    the file would not fit in half the free memory it is rounded to bf16, and the reason says so."""
    model, _, f32 = checkpoints("qwen3")
    _, _, gguf = checkpoints("qwen3", outtype="f16")
    source, cpu = resolve(str(gguf), pull_missing=False), resolve_device("cpu")
    assert dtype_policy.stored_matrix_type(source) == "F16"
    served = load_ours(gguf, dtype="auto")
    assert served.model.dtype == torch.float32
    ref_model, missed = dequantized_reference(copy.deepcopy(model), f32, gguf)
    assert missed == 0
    assert max_logprob_diff(our_logits(served.model), reference_logits(ref_model)) < F32_BOUND
    monkeypatch.setattr(dtype_policy, "F16_FLOAT32_RAM_FRACTION", 0.0)
    choice = dtype_policy.choose_dtype("auto", cpu, source)
    assert choice.dtype == torch.bfloat16 and "more than half" in choice.why


def test_explicit_dtype_and_random_weights_are_not_the_files(checkpoints) -> None:
    _, _, gguf = checkpoints("qwen3")
    source, cpu = resolve(str(gguf), pull_missing=False), resolve_device("cpu")
    assert dtype_policy.choose_dtype("auto", cpu, source).dtype == torch.float32
    assert dtype_policy.choose_dtype("bfloat16", cpu, source).dtype == torch.bfloat16
    assert dtype_policy.choose_dtype("auto", cpu, source, load_format="dummy").dtype == torch.bfloat16
    assert dtype_policy.choose_dtype("auto", cpu, source, quantize="int4").dtype == torch.bfloat16


def test_memory_estimate_counts_an_f32_file_once(checkpoints) -> None:
    """The server's fit check: an F32 file at dtype auto takes its own size (not the 8x of a dequantized 4-bit file)."""
    from edgeserve.server.config import ServerConfig
    from edgeserve.server.model_manager import estimate_memory, source_bytes

    _, _, gguf = checkpoints("qwen3")
    source = resolve(str(gguf), pull_missing=False)
    assert estimate_memory(source, ServerConfig(device="cpu")).weights == source_bytes(source)
