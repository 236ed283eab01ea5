"""What the fused-native-stack tests of each architecture share: a LoadedModel around a bare model (a stub
tokenizer), and running the same thing fused and per-op."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Callable

from edgeserve.models.load import LoadedModel


def stub_loaded(model, name: str, folder: Path) -> LoadedModel:
    """`model` as a LoadedModel named `name` with a tokenizer that never ends a sequence and decodes to ""."""
    tokenizer = SimpleNamespace(eot_ids=frozenset(), decode=lambda ids: "", byte_fallback_ids=frozenset())
    return LoadedModel(name, SimpleNamespace(path=folder), model.config, model, tokenizer, None, 0.0)


def fused_and_per_op(model, run: Callable[[], list]) -> list:
    """`run()` with the model on its fused native stack, then on its per-op path (each time checked to be so): both
    outputs, fused first, asserted equal."""
    outputs = []
    for fused in (True, False):
        model._native = False if fused else None
        outputs.append(run())
        assert (model._native is not None) == fused
    assert outputs[0] == outputs[1]
    return outputs
