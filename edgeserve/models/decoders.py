"""Which decoder class runs which architecture: its package's answer (edgeserve.models.registry)."""

from __future__ import annotations

from typing import Any

from .config import ModelConfig
from .registry import architecture


def decoder_class(config: ModelConfig) -> type[Any]:
    """The decoder that runs `config`'s architecture (its package's `model.model_class`)."""
    return architecture(config.architecture).part("model").model_class(config)


def dummy_decoder_class(config: ModelConfig) -> type[Any]:
    """The decoder that runs random weights (edgeserve.models.dummy) of `config`'s shape, or a ModelLoadError where
    the architecture declares it has none (DUMMY_WEIGHTS false)."""
    from edgeserve.errors import ModelLoadError

    spec = architecture(config.architecture)
    if not spec.declared("DUMMY_WEIGHTS", True):
        raise ModelLoadError(f"--load-format dummy has no random weights for {config.architecture}'s block yet")
    model = spec.part("model")
    return getattr(model, "dummy_model_class", model.model_class)(config)
