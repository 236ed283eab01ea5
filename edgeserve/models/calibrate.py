"""Calibration for activation-aware INT4 quantization: run a text through the float model, record what each
layer's q/k/v, gate/up and down matrices see, and pick per-channel scales (see edgeserve.loaders.quantize)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgeserve.errors import EdgeserveError
from edgeserve.loaders.quantize import awq_search
from edgeserve.loaders.weights import WeightSource

from .attention import ContiguousKV
from .config import ModelConfig
from .llama import LlamaModel

MAX_CALIBRATION_TOKENS = 2048  # tokens run through the model
MAX_SEARCH_ROWS = 256  # activation rows per matrix kept for the scale search


class _Recorder:
    """Stands in for a dense layer matrix: keeps (a sample of) the inputs it is applied to, computes as before."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.inputs: list[torch.Tensor] = []

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs.append(x.reshape(-1, x.shape[-1]).float().cpu())
        return F.linear(x.to(self.weight.dtype), self.weight)

    def sample(self, generator: torch.Generator) -> torch.Tensor:
        x = torch.cat(self.inputs)
        if x.shape[0] > MAX_SEARCH_ROWS:
            x = x[torch.randperm(x.shape[0], generator=generator)[:MAX_SEARCH_ROWS]]
        return x


def awq_scales(config: ModelConfig, source: WeightSource, ids: list[int], group_size: int, dtype: torch.dtype,
               device: torch.device) -> dict[int, dict[str, torch.Tensor]]:
    """Per layer {"attn", "mlp", "down"} input-channel scales from running `ids` through the float model.

    The float model is built once for this (so calibration needs the memory of the unquantized model) and freed
    before the quantized load.
    """
    if config.is_moe:
        raise EdgeserveError("activation-aware calibration does not cover Mixture-of-Experts models yet; quantize "
                             "without --quantize-calibration (their experts then stay in float)")
    if config.post_norms:  # the scales fold into the norms before q/k/v and gate/up, which OLMo 2 has not
        raise EdgeserveError(f"activation-aware calibration does not cover {config.architecture}'s block (no norm "
                             "before attention or the MLP to fold its scales into); quantize without "
                             "--quantize-calibration")
    if len(ids) < 2:
        raise EdgeserveError("the calibration text is too short (it needs at least a few tokens)")
    ids = ids[:MAX_CALIBRATION_TOKENS]
    model = LlamaModel.from_weights(config, source, dtype=dtype, device=device, keep_int4=False)
    slots = ("qkv", "gate_up", "down")
    recorders = []
    for layer in model.layers:
        recs = {s: _Recorder(getattr(layer, s)) for s in slots}
        for s, r in recs.items():
            setattr(layer, s, r)
        recorders.append(recs)
    chunk = min(512, model.max_positions)
    for start in range(0, len(ids), chunk):
        part = torch.tensor(ids[start:start + chunk], device=device)
        kv = ContiguousKV(config.num_layers, len(part), config.num_kv_heads, config.head_dim, dtype, device)
        model.forward(part, torch.arange(len(part), device=device), kv)
    gen = torch.Generator().manual_seed(0)
    scales = {}
    for i, recs in enumerate(recorders):
        scales[i] = {name: awq_search(recs[slot].sample(gen), recs[slot].weight.cpu(), group_size)
                     for name, slot in (("attn", "qkv"), ("mlp", "gate_up"), ("down", "down"))}
        for r in recs.values():
            r.inputs.clear()
    return scales
