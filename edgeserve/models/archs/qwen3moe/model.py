"""The Llama-family decoder with a Mixture-of-Experts feed-forward in every layer (Qwen3 MoE): Llama's attention
(Q/K norms as Qwen3's) and edgeserve.models.moe's MoELayer in place of the gated MLP."""

from __future__ import annotations

from typing import Any, Callable

import torch

from edgeserve.kernels.formats.quant_linear import LinearWeight
from edgeserve.loaders.weights import WeightSource

from edgeserve.models.config import ModelConfig
from edgeserve.models.llama import LlamaModel
from edgeserve.models.moe_weights import load_moe_layer


class MoEModel(LlamaModel):
    """A Llama-family MoE decoder over flat token batches (same interface as LlamaModel). On the CPU with
    block-format weights its steps run in the fused native layer stack, each MoE layer one moe_layer.c call there
    (kernels.cpu.decoder, kernels.cpu.decoder_moe); elsewhere the per-op path."""

    @classmethod
    def feed_forward(cls, config: ModelConfig, source: WeightSource, i: int, matrix: Callable[[list[str]], LinearWeight],
                     device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
        """Layer i's MoE layer, in place of the gated MLP."""
        return dict(gate_up=None, down=None, moe=load_moe_layer(config, source, i, matrix, device, dtype))


def model_class(config: ModelConfig) -> type[LlamaModel]:
    """Llama's decoder with Mixture-of-Experts layers; a file without experts: Llama's (edgeserve.models.registry's
    hook)."""
    return MoEModel if config.is_moe else LlamaModel
