"""The decoder of OLMo 2 / 3."""

from __future__ import annotations

from edgeserve.models.config import ModelConfig
from edgeserve.models.olmo2 import Olmo2Model


def model_class(config: ModelConfig) -> type[Olmo2Model]:
    """OLMo 2's block (no pre-norms)."""
    return Olmo2Model
