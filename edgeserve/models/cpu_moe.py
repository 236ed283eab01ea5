"""--cpu-moe-layers N|all (llama.cpp's --n-cpu-moe): the routed experts of the first N MoE layers stay in host
memory, in the file's block formats on the native CPU kernels, while attention, the router, shared experts and
the rest of the model sit on the model's device.

This module holds the option's parsing and validation, and the placement the loader consults while it builds each
MoE layer (`host_experts`, a context that `load_model` opens around a load; `next_layer_on_host` answers, layer
by layer, whether the experts being loaded go to the host). On a CPU-only run it changes nothing.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from edgeserve.errors import EdgeserveError

if TYPE_CHECKING:  # the CLI parses the flag without importing torch
    import torch

FLAG = "--cpu-moe-layers"
CpuMoeLayers = int | str | None  # None / 0: off; a count of MoE layers; "all"


def parse_cpu_moe_layers(value: CpuMoeLayers) -> int | str | None:
    """`value` checked and normalized: None (off), "all", or a non-negative count (0 is off, returned as None).
    Anything else raises a one-line ValueError naming the flag."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "all":
            return "all"
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{FLAG} must be a non-negative integer or 'all', not {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{FLAG} must be a non-negative integer or 'all', not {value!r}")
    if value < 0:
        raise ValueError(f"{FLAG} must be a non-negative integer or 'all', not {value}")
    return value or None


def moe_layer_count(config) -> int:
    """How many of a model's layers have routed experts (every layer of the MoE architectures edgeserve runs)."""
    return config.num_layers if config.is_moe else 0


def host_expert_layers(value: CpuMoeLayers, config) -> int:
    """How many MoE layers (the first ones) keep their experts on the host for `value` and the model's config;
    raises EdgeserveError (one line, naming the flag) for a model without experts or a count over its MoE layers."""
    n = parse_cpu_moe_layers(value)
    if n is None:
        return 0
    total = moe_layer_count(config)
    if total == 0:
        raise EdgeserveError(f"{FLAG}: {config.architecture} has no experts (it is not a Mixture-of-Experts model)")
    if n == "all":
        return total
    if n > total:
        raise EdgeserveError(f"{FLAG} {n} is more than the model's {total} MoE layers")
    return n


@dataclass
class _Placement:
    """The experts of the first `layers` MoE layers loaded go to the host; `loaded` counts MoE layers so far."""

    layers: int
    loaded: int = 0


_PLACEMENT: ContextVar[_Placement | None] = ContextVar("edgeserve_cpu_moe_placement", default=None)


@contextmanager
def host_experts(layers: int) -> Iterator[None]:
    """While open, the first `layers` MoE layers that load (in load order, which is layer order) keep their
    experts on the host (`next_layer_on_host`)."""
    token = _PLACEMENT.set(_Placement(layers) if layers > 0 else None)
    try:
        yield
    finally:
        _PLACEMENT.reset(token)


def next_layer_on_host() -> bool:
    """Whether the MoE layer being loaded keeps its experts on the host (called once per MoE layer by the loader)."""
    placement = _PLACEMENT.get()
    if placement is None:
        return False
    placement.loaded += 1
    return placement.loaded <= placement.layers


def applies_to(device: "torch.device") -> bool:
    """Whether host experts mean anything on `device`: not on a CPU, where every weight is in host memory already."""
    return device.type != "cpu"
