"""The scaffolding LlamaModel-interface decoders share beyond their common fields (llama.set_decoder_fields): building
from a WeightLoader, the norm that ends a layer, and (for hybrids with recurrent state beside the paged KV pool:
Mamba-2, short-conv, DeltaNet) the step's states with the checks each forward makes first."""

from __future__ import annotations

import torch

from edgeserve.kernels.formats.quant_linear import LinearWeight
from edgeserve.loaders.weights import WeightSource
from edgeserve.models.config import ModelConfig
from edgeserve.models.llama import LlamaModel, set_decoder_fields
from edgeserve.models.weight_loader import WeightLoader


def step_states(attn, positions: torch.Tensor, max_positions: int, model_name: str, state_kind: str,
                needs: tuple[str, ...] = ("layer_cache", "attend")):
    """The step's recurrent states (`attn.states`), after checking that `attn` is the paged KV pool with states
    beside it (it has every attribute in `needs`) and that no position is past `max_positions`."""
    states = getattr(attn, "states", None)
    if not all(hasattr(attn, name) for name in needs) or states is None:
        raise TypeError(f"{model_name} runs over the paged KV pool with {state_kind} states beside it "
                        "(PagedKVAttention with `states`)")
    if positions.shape[0] and int(positions.max()) >= max_positions:
        raise IndexError(f"position {int(positions.max())} is past the model's {max_positions}")
    return states


def next_norm(model: LlamaModel, i: int) -> torch.Tensor:
    """The norm that follows layer i: the next layer's input norm, or the final norm after the last layer."""
    return model.norm if i + 1 == len(model.layers) else model.layers[i + 1].input_norm


class LoadedDecoder(LlamaModel):
    """A decoder built from a WeightLoader over its view of the weight source: subclasses say the view
    (`weight_view`) and build themselves from the loader (`load`)."""

    @classmethod
    def from_weights(cls, config: ModelConfig, source: WeightSource, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu", keep_int4: bool = True, dense_prefill: bool = False):
        """Build the model from a weight source (an HF checkpoint's names or a GGUF file's)."""
        view = cls.weight_view(config, source)
        return cls.load(config, WeightLoader(view, dtype, torch.device(device), keep_int4, dense_prefill))

    @classmethod
    def weight_view(cls, config: ModelConfig, source: WeightSource) -> WeightSource:
        """The source under the names `load` reads (the source itself unless a subclass renames)."""
        return source

    @classmethod
    def load(cls, config: ModelConfig, w: WeightLoader):
        """Build the model from its tensors."""
        raise NotImplementedError


class PerOpHybridDecoder(LoadedDecoder):
    """A decoder without a fused native plan (every step takes the per-op path) and with the common fields only."""

    def __init__(self, config: ModelConfig, embed, layers: list, norm: torch.Tensor, lm_head: LinearWeight,
                 dtype: torch.dtype, device: torch.device):
        set_decoder_fields(self, config, embed, layers, norm, lm_head, dtype, device)
        self._native = None

    def native_plan(self):
        """No fused native plan here (a subclass with one overrides this): every step takes the per-op path."""
        return None
