"""Build a layer's MoELayer from a weight source: GGUF (3-D expert tensors kept as block bytes for the native CPU
kernels, else dequantized) or an HF checkpoint (fused `mlp.experts.gate_up_proj` / `down_proj`, or the older
per-expert `mlp.experts.N.gate_proj.weight` ...); non-gated experts (MoEConfig.gated False) from `up_proj` alone."""

from __future__ import annotations

import os
from typing import Callable

import torch

from edgeserve.errors import ModelLoadError
from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.dispatch import use_triton
from edgeserve.kernels.formats.experts import BlockExperts, DenseExperts, ExpertBlocks, Experts
from edgeserve.kernels.formats.quant_linear import LinearWeight
from edgeserve.loaders.weights import WeightSource

from .config import ModelConfig
from .cpu_moe import next_layer_on_host
from .moe import GatedActivation, MoEConfig, MoELayer, SharedExpert


def moe_config(config: ModelConfig, router: str = "softmax_topk",
               activation: str | GatedActivation = "silu") -> MoEConfig:
    """The MoEConfig of a model's expert layers."""
    return MoEConfig(config.num_experts, config.experts_per_token, config.moe_intermediate_size, router,
                     config.norm_topk_prob, activation)


def native_experts_here(source: WeightSource, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether expert tensors may stay in block formats on the native kernels (the rule of cpu_native.block_weight:
    a CPU where Triton does not take the kernels, a reduced-precision compute dtype, the library loaded, a source
    that gives block bytes)."""
    return (device.type == "cpu" and not use_triton(device) and dtype != torch.float32
            and hasattr(source, "expert_blocks") and cpu_native.available())


REPACK_RAM_FRACTION = 0.5
_SETTINGS = {"1": True, "on": True, "true": True, "yes": True, "0": False, "off": False, "false": False, "no": False}


def want_repacked_experts(source: WeightSource) -> bool:
    """Whether to copy a GGUF's block-format experts into the native kernels' faster layout (several times faster
    for the rows of a prompt, somewhat for decode) instead of reading them from the file's memory map: the
    environment's EDGESERVE_MOE_REPACK (1 / 0) when set, else when all of the file's expert tensors take at most
    REPACK_RAM_FRACTION of the machine's memory."""
    setting = os.environ.get("EDGESERVE_MOE_REPACK", "").strip().lower()
    if setting:
        if setting not in _SETTINGS:
            raise ModelLoadError(f"EDGESERVE_MOE_REPACK must be 1 or 0, not {setting!r}")
        return _SETTINGS[setting]
    total = getattr(source, "expert_bytes", None)
    if total is None:
        return False
    import psutil

    return total <= REPACK_RAM_FRACTION * psutil.virtual_memory().total


def _float(source: WeightSource, name: str) -> torch.Tensor:
    value = source.get(name, keep_int4=False)
    assert isinstance(value, torch.Tensor)
    return value.float()


def host_experts_native(source: WeightSource) -> bool:
    """Whether experts kept on the host (--cpu-moe-layers) may stay in block formats on the native kernels: the
    library loaded and a source that gives block bytes (whatever the model's device and compute dtype)."""
    return hasattr(source, "expert_blocks") and cpu_native.available()


def _experts(source: WeightSource, names: list[str], native: bool, device: torch.device,
             dtype: torch.dtype, repack: bool | None = None) -> Experts:
    """The 3-D tensors `names` stacked along their rows: BlockExperts when every one is in a native block format
    (and `native`; repacked per `repack`, default `want_repacked_experts`), else DenseExperts in `dtype` on
    `device`."""
    if native:
        parts = [source.expert_blocks(n) for n in names]  # type: ignore[attr-defined]
        if all(isinstance(p, ExpertBlocks) for p in parts):
            repack = want_repacked_experts(source) if repack is None else repack
            return BlockExperts(parts, repack=repack)  # type: ignore[arg-type]
    tensors = [_float(source, n).to(device=device, dtype=dtype) for n in names]
    return DenseExperts(tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=1))


def _per_expert(source: WeightSource, p: str, e: int, names: list[str], device: torch.device,
                dtype: torch.dtype) -> DenseExperts:
    """DenseExperts from per-expert 2-D tensors `{p}mlp.experts.{j}.{name}.weight` (rows of `names` stacked)."""
    stacked = torch.empty(0)
    for j in range(e):
        w = torch.cat([_float(source, f"{p}mlp.experts.{j}.{n}.weight") for n in names]).to(device=device, dtype=dtype)
        if j == 0:
            stacked = torch.empty((e, *w.shape), dtype=dtype, device=device)
        stacked[j] = w
    return DenseExperts(stacked)


def _bias(source: WeightSource, names: list[str]) -> torch.Tensor | None:
    """The expert biases `names` ([E, rows] each) side by side, or None when the model has none."""
    if not all(source.has(n) for n in names):
        return None
    return torch.cat([_float(source, n) for n in names], dim=1)


def load_moe_layer(config: ModelConfig, source: WeightSource, i: int, matrix: Callable[[list[str]], LinearWeight],
                   device: torch.device, dtype: torch.dtype, moe: MoEConfig | None = None,
                   choice_bias: torch.Tensor | None = None) -> MoELayer:
    """Layer i's MoE feed-forward (`matrix`: the decoder loader's dense linear weights, for the shared expert;
    `choice_bias`: a sigmoid_bias router's, as the model's loader read it). Its experts and their biases go to the
    host instead of `device` when edgeserve.models.cpu_moe's placement says so (--cpu-moe-layers); the router and
    the shared expert stay on `device`."""
    moe = moe or moe_config(config)
    p = f"model.layers.{i}.mlp."
    e = config.num_experts
    on_host = next_layer_on_host()
    expert_device = torch.device("cpu") if on_host else device
    native = host_experts_native(source) if on_host else native_experts_here(source, device, dtype)
    if not moe.gated:  # an up projection alone (Nemotron-H): fused [E, F, hidden] or per expert
        if source.has(p + "experts.up_proj"):
            gate_up = _experts(source, [p + "experts.up_proj"], native, expert_device, dtype)
        else:
            gate_up = _per_expert(source, f"model.layers.{i}.", e, ["up_proj"], expert_device, dtype)
        gate_up_bias = None
    elif source.has(p + "experts.gate_up_proj"):
        gate_up = _experts(source, [p + "experts.gate_up_proj"], native, expert_device, dtype)
        gate_up_bias = _bias(source, [p + "experts.gate_up_proj_bias"])
    elif source.has(p + "experts.gate_proj"):
        gate_up = _experts(source, [p + "experts.gate_proj", p + "experts.up_proj"], native, expert_device, dtype)
        gate_up_bias = _bias(source, [p + "experts.gate_proj_bias", p + "experts.up_proj_bias"])
    elif source.has(p + "experts.0.gate_proj.weight"):
        gate_up = _per_expert(source, f"model.layers.{i}.", e, ["gate_proj", "up_proj"], expert_device, dtype)
        gate_up_bias = None
    else:
        raise ModelLoadError(f"layer {i} has no expert weights (mlp.experts.gate_up_proj or gate_proj / up_proj)")
    if source.has(p + "experts.down_proj"):
        down = _experts(source, [p + "experts.down_proj"], native, expert_device, dtype)
    else:
        down = _per_expert(source, f"model.layers.{i}.", e, ["down_proj"], expert_device, dtype)
    down_bias = _bias(source, [p + "experts.down_proj_bias"])
    shared = None
    if source.has(p + "shared_expert.gate_proj.weight"):
        gate = _float(source, p + "shared_expert_gate.weight").to(device) if source.has(
            p + "shared_expert_gate.weight") else None
        shared = SharedExpert(matrix([p + "shared_expert.gate_proj.weight", p + "shared_expert.up_proj.weight"]),
                              matrix([p + "shared_expert.down_proj.weight"]), gate, moe.activation)
    router_bias = _float(source, p + "gate.bias").to(device) if source.has(p + "gate.bias") else None
    layer = MoELayer(moe, _float(source, p + "gate.weight").to(device), gate_up, down, router_bias=router_bias,
                     gate_up_bias=None if gate_up_bias is None else gate_up_bias.to(expert_device),
                     down_bias=None if down_bias is None else down_bias.to(expert_device), shared=shared,
                     choice_bias=None if choice_bias is None else choice_bias.float().to(device))
    layer.experts_on_host = on_host
    return layer
