"""What each layer of a model keeps per sequence: the one place the engine reads a model's cache layout.

A layer's K/V cache is one of
- "full": K/V of every token (global attention);
- "window": K/V of the last `window` tokens (sliding-window attention);
- "shared": none of its own; it attends over layer `source`'s K/V (Gemma 4's KV-shared layers);
- "none": no K/V (a state layer, Nemotron-H's MLP-only blocks);
and beside it a layer may keep a recurrent state of kind `state` (engine.cache.state_pool.LayerStateKind, or Gated
DeltaNet's dims), the same size at any length: Qwen3.5's Gated DeltaNet, LFM2's short convolution and Mamba-2
layers instead of K/V, Falcon-H1's Mamba-2 beside its attention.
The KV pool, its window pool, the KV formats and the state pool are sized from these specs (vLLM's
kv_cache_interface plays this part there); the architectures state them through their config's fields
(`layer_windows`, `kv_shared_layers`, `global_head_dim` / `global_kv_heads`, `linear_layers` with `state_kind` or
`delta`, `mixerless_layers`), read here once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edgeserve.models.config import ModelConfig

KINDS = ("full", "window", "shared", "none")


@dataclass(frozen=True)
class LayerCache:
    """One layer's cache: its K/V kind (with the heads and head size it stores) and the state it keeps, if any."""

    kind: str
    kv_heads: int = 0
    head_dim: int = 0
    window: int | None = None  # "window": tokens it sees
    source: int | None = None  # "shared": the layer whose K/V it reads
    state: Any = None  # the recurrent state it keeps (a LayerStateKind or Gated DeltaNet's dims); None: none

    @property
    def owns_kv(self) -> bool:
        """Whether the layer stores K/V of its own."""
        return self.kind in ("full", "window")


def layer_caches(config: ModelConfig) -> tuple[LayerCache, ...]:
    """Each layer's cache, in layer order."""
    out = []
    for i in range(config.num_layers):
        state = config.layer_state if config.is_linear(i) else None
        if not config.keeps_kv(i):
            out.append(LayerCache("none", state=state))
        elif config.kv_source(i) != i:
            out.append(LayerCache("shared", source=config.kv_source(i), state=state))
        else:
            window = None if config.is_global(i) else config.layer_windows[i]
            out.append(LayerCache("window" if window is not None else "full", config.layer_kv_heads(i),
                                  config.layer_head_dim(i), window=window, state=state))
    return tuple(out)


def kv_owners(config: ModelConfig) -> list[int]:
    """The layers that keep K/V of their own (not those reading another's, not state layers, not mixerless
    blocks)."""
    return [i for i, c in enumerate(layer_caches(config)) if c.owns_kv]


def kv_source(caches: tuple[LayerCache, ...], layer: int) -> int | None:
    """The layer whose K/V `layer` reads (itself when it owns some; None for a layer without K/V)."""
    c = caches[layer]
    return layer if c.owns_kv else c.source if c.kind == "shared" else None


def state_layers(config: ModelConfig) -> tuple[int, Any]:
    """(how many layers keep a recurrent state, the state kind they keep); (0, None) for a model without any."""
    states = [c.state for c in layer_caches(config) if c.state is not None]
    return len(states), (states[0] if states else None)
