"""Every architecture in edgeserve.models.registry, one parametrized run each (issue 48): it has a converter-parity
case (tests/converter_cases.py; an architecture registered without one fails here), each of its cases loads with
`--load-format dummy` (or is refused by name where its package declares no random weights), and matches
transformers' float32 logits through a GGUF made by llama.cpp's own converter and through its HF folder. A drafter
(its package declares DRAFTER: a Gemma 4 assistant, which reads a target's K/V) is compared over its target by its
own test module (tests/models/test_gemma4_assistant.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from converter_cases import CASES  # noqa: E402
from converter_parity import IDS, load_ours, max_logprob_diff, our_logits  # noqa: E402

from edgeserve.errors import ModelLoadError  # noqa: E402
from edgeserve.models import registry  # noqa: E402

# float32 noise: the same math in another order over 2-7 layers of width 64 (measured at most 4.8e-5)
F32_BOUND = 2e-4
# the borrowed vocabularies' size ceiling: every id of IDS is inside
DUMMY_VOCAB = 32000


def drafter(arch: str) -> bool:
    """Whether `arch` drafts over a target model (it has no logits of its own)."""
    return bool(registry.architecture(arch).declared("DRAFTER", False))


def cases_for(arch: str) -> list:
    """The converter cases whose HF folder is `arch` (a case's `ours`, else the GGUF architecture it converts to)."""
    return [c for c in CASES if (c.ours or c.arch) == arch]


@pytest.mark.parametrize("arch", registry.names())
def test_has_a_converter_case(arch: str) -> None:
    assert cases_for(arch), f"registered architecture {arch!r} has no case in tests/converter_cases.py"


@pytest.mark.parametrize("arch", registry.names())
def test_loads_with_dummy_weights(arch: str, tmp_path: Path) -> None:
    """Random weights of each case's config.json shape run a prompt and decode steps to finite logits."""
    from edgeserve.models.load import load_model
    from edgeserve.registry.resolve import resolve

    for case in cases_for(arch) or pytest.fail(f"{arch!r} has no converter case"):
        path = tmp_path / f"{case.name}.json"
        path.write_text(json.dumps(case.config(DUMMY_VOCAB).to_dict()))
        if not registry.architecture(arch).declared("DUMMY_WEIGHTS", True):
            with pytest.raises(ModelLoadError, match="no random weights"):
                load_model(resolve(str(path)), dtype="float32", load_format="dummy")
            pytest.xfail(f"{arch}'s package declares no random weights (DUMMY_WEIGHTS = False)")
        loaded = load_model(resolve(str(path)), dtype="float32", load_format="dummy")
        assert loaded.config.architecture == arch, case.name
        if drafter(arch):  # runs over a target's K/V only (tests/models/test_gemma4_assistant.py)
            assert loaded.config.backbone_hidden_size > 0, case.name
            continue
        logits = our_logits(loaded.model)
        assert logits.shape == (len(IDS), loaded.config.vocab_size) and torch.isfinite(logits).all(), case.name


def compared_cases(arch: str, checkpoints):
    """(case, (HF model, HF folder, f32 GGUF)) of each converter case of `arch`; an assistant drafter skipped (it
    runs over a target's K/V), an architecture without a case failed."""
    if drafter(arch):
        pytest.skip(f"{arch} drafts over a target's K/V: tests/models/test_gemma4_assistant.py compares it")
    for case in cases_for(arch) or pytest.fail(f"{arch!r} has no converter case"):
        yield case, checkpoints(case.name)


def assert_logits_match(label: str, loaded, ref: torch.Tensor) -> None:
    """Our float32 logits of `loaded` are transformers' `ref` within float32 noise."""
    diff = max_logprob_diff(our_logits(loaded.model), ref)
    print(f"{label}: max |logprob diff| {diff:.2e}")
    assert diff < F32_BOUND, label


@pytest.mark.parametrize("arch", registry.names())
def test_f32_gguf_matches_transformers(arch: str, checkpoints, reference) -> None:
    for case, (_, _, gguf) in compared_cases(arch, checkpoints):
        loaded = load_ours(gguf)
        assert loaded.config.architecture == case.arch, case.name
        ref = reference(case.name)
        assert ref.abs().max() > 1.0, case.name  # a model whose logits say something
        assert_logits_match(f"{case.name} f32 GGUF", loaded, ref)


@pytest.mark.parametrize("arch", registry.names())
def test_hf_folder_matches_transformers(arch: str, checkpoints, reference) -> None:
    for case, (_, folder, _) in compared_cases(arch, checkpoints):
        loaded = load_ours(folder)
        assert loaded.config.architecture == arch, case.name
        assert_logits_match(f"{case.name} HF folder", loaded, reference(case.name))
