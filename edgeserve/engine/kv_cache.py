"""The KV pool's memory: one K and one V tensor per model, blocks of `block_size` slots, sized from a budget."""

from __future__ import annotations

import torch

from edgeserve.kernels.dispatch import AttentionMetadata, paged_attention, write_kv
from edgeserve.models.config import ModelConfig


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of K and V one token takes over all layers."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * torch.empty((), dtype=dtype).element_size()


def free_memory_bytes(device: torch.device) -> int:
    """Memory free for the KV pool now: the device's free memory on CUDA, available RAM elsewhere."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def num_blocks_for_budget(budget_bytes: float, config: ModelConfig, dtype: torch.dtype, block_size: int) -> int:
    """How many blocks of `block_size` tokens fit in `budget_bytes`."""
    return int(budget_bytes // (kv_bytes_per_token(config, dtype) * block_size))


class KVPool:
    """K and V for every layer: [num_layers, num_blocks, block_size, num_kv_heads, head_dim] each, zeroed."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        # zeroed, not empty: attention reads padded slots with weight 0, and 0 * NaN garbage would be NaN
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class PagedKVAttention:
    """The model's KVAttention for one step: writes the step's K/V to its slots and attends through block tables."""

    def __init__(self, pool: KVPool, meta: AttentionMetadata, scale: float | None = None) -> None:
        self.pool = pool
        self.meta = meta
        self.scale = scale

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache, slots = self.layer_cache(layer)
        write_kv(k_cache, v_cache, k, v, slots)
        return self.attend(layer, q)

    def layer_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One layer's K and V pool and the slot of each of this step's tokens (for a fused RoPE + K/V write)."""
        return self.pool.k[layer], self.pool.v[layer], self.meta.slot_mapping

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of q [T, H, D] over this layer's pool, this step's K/V already written: [T, H * D]."""
        return paged_attention(q, self.pool.k[layer], self.pool.v[layer], self.meta, self.scale).reshape(q.shape[0], -1)
