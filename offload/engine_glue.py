"""Build the offload tiers for one engine: its model identity, KV layout and pool."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .config import OffloadConfig
from .layout import KVLayout, model_identity
from .pool_bridge import PoolOffload
from .tier_manager import TierManager

if TYPE_CHECKING:
    from edgeserve.models.load import LoadedModel


def kv_layout_for(lm: LoadedModel, k_pool: torch.Tensor, kv_format: str = "", state_pool: Any = None) -> KVLayout:
    """The block layout of `lm`'s KV pool, keyed by the model file and what changes the KV values it computes
    (edgeserve version, compute dtype, device type, the pool's KV format such as q8_0, a hybrid's state format from
    `state_pool`), so a disk block or state is reused only where it is bit-identical: a bf16 block file is never
    read into a q8_0 pool."""
    from edgeserve import __version__

    model = lm.model
    extra = f"edgeserve {__version__}; compute {model.dtype}; device {model.device.type}"
    num_layers, _, block_size, num_kv_heads, head_dim = k_pool.shape
    spec = state_pool.spec if state_pool is not None else None
    return KVLayout(model_identity(lm.source.path, extra), k_pool.dtype, num_layers, block_size, num_kv_heads,
                    head_dim, kv_format, state_format=spec.format if spec else "",
                    state_nbytes=spec.bytes_per_sequence if spec else 0)


def build_pool_offload(config: OffloadConfig, lm: LoadedModel, k_pool: torch.Tensor,
                       v_pool: torch.Tensor, kv_format: str = "", state_pool: Any = None) -> PoolOffload | None:
    """The bridge between `lm`'s KV pool (and a hybrid's state pool, engine.cache.state_pool.StatePool) and its tiers, or
    None when offload is off (`kv_format`: the pool's KV format name where it is quantized, e.g. q8_0)."""
    if not config.use_cpu:
        return None
    tiers = TierManager.from_config(config, kv_layout_for(lm, k_pool, kv_format, state_pool))
    return PoolOffload(tiers, k_pool, v_pool, state_pool)
