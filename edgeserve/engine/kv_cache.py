"""The KV pool's memory: one K and one V tensor per model, blocks of `block_size` slots, sized from a budget."""

from __future__ import annotations

import torch

from edgeserve.kernels.dispatch import AttentionMetadata, paged_attention, write_kv
from edgeserve.kernels.transfer import to_device
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
                 device: torch.device | str = "cpu", scratch_block: bool = False) -> None:
        """`scratch_block`: one more block after the `num_blocks` the scheduler owns, where the padding rows of a
        CUDA-graph decode batch write (its id is `self.scratch_block`; None without one)."""
        self.scratch_block: int | None = num_blocks if scratch_block else None
        total = num_blocks + (1 if scratch_block else 0)
        shape = (config.num_layers, total, block_size, config.num_kv_heads, config.head_dim)
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

    def attend(self, layer: int, q: torch.Tensor, window: int | None = None, softcap: float | None = None,
               scale: float | None = None) -> torch.Tensor:
        """Attention of q [T, H, D] over this layer's pool, this step's K/V already written: [T, H * D].
        `window`: a sliding-window layer; `softcap`: attention-logit soft-capping; `scale`: overrides the pool's."""
        return paged_attention(q, self.pool.k[layer], self.pool.v[layer], self.meta,
                               self.scale if scale is None else scale, window, softcap).reshape(q.shape[0], -1)


def warmup_peak_bytes(model, config: ModelConfig, num_tokens: int, num_rows: int, block_size: int) -> int:
    """Run one forward of `num_tokens` prompt tokens (the largest step) plus the logits and a softmax of
    `num_rows` rows over a throwaway pool, and return `torch.cuda.max_memory_allocated` over it (CUDA only)."""
    dev = model.device
    num_blocks = -(-num_tokens // block_size)
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    pool = KVPool(config, num_blocks, block_size, model.dtype, dev)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
    positions = torch.arange(num_tokens, dtype=torch.long, device=dev)
    hidden = forward_batch(model, pool, ids, positions, [num_tokens], [num_tokens], [list(range(num_blocks))],
                           list(range(num_tokens)))
    rows = hidden[-1:].expand(min(num_rows, num_tokens), -1).contiguous()
    torch.softmax(model.logits(rows), dim=-1)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    del pool, hidden, rows
    torch.cuda.empty_cache()
    return int(peak)


def gpu_pool_budget(model, config: ModelConfig, num_tokens: int, num_rows: int, block_size: int,
                    fraction: float) -> int:
    """KV pool bytes on a GPU: `fraction` of the device, less what is used outside torch, less the peak of a
    warm-up forward at the largest step (weights included); see `edgeserve.device.gpu_kv_budget`."""
    from edgeserve.device import gpu_kv_budget

    peak = warmup_peak_bytes(model, config, num_tokens, num_rows, block_size)
    free, total = torch.cuda.mem_get_info(model.device)
    return gpu_kv_budget(int(total), int(free), int(torch.cuda.memory_reserved(model.device)), peak, fraction)


def size_pool(lm, config) -> tuple[int, int]:
    """(KV blocks, usable context) of one engine: the budget (`kv_cache_gb`, else what the GPU memory fraction
    leaves after the weights and a warm-up step, else a fraction of free host memory) in blocks, no more than every
    seat filled to the full context; the context shrinks to what the pool holds. ValueError when no block fits."""
    model = lm.model
    max_model_len = min(config.max_model_len or model.max_positions, model.max_positions)
    if config.kv_cache_gb:
        budget = config.kv_cache_gb * 2**30
    elif model.device.type == "cuda":
        budget = gpu_pool_budget(model, lm.config, min(config.max_num_batched_tokens, max_model_len),
                                 config.max_num_seqs, config.block_size, config.gpu_memory_fraction)
    else:
        budget = config.kv_cache_fraction * free_memory_bytes(model.device)
    num_blocks = num_blocks_for_budget(budget, lm.config, model.dtype, config.block_size)
    blocks_per_seq = -(-max_model_len // config.block_size)
    num_blocks = min(num_blocks, blocks_per_seq * config.max_num_seqs)
    if num_blocks < 1:
        need = kv_bytes_per_token(lm.config, model.dtype) * config.block_size
        hint = (" (the GPU is full after the weights and a warm-up step: raise --gpu-memory-fraction or lower "
                "--max-batched-tokens)" if model.device.type == "cuda" and not config.kv_cache_gb else "")
        raise ValueError(f"the KV cache budget of {budget / 2**20:.1f} MiB holds no block of "
                         f"{need / 2**20:.2f} MiB{hint}")
    if num_blocks < blocks_per_seq:  # a request may not use more context than the pool holds
        max_model_len = num_blocks * config.block_size
    return num_blocks, max_model_len


def forward_batch(model, pool: "KVPool", token_ids: torch.Tensor | list[int], positions: torch.Tensor | list[int],
                  query_lens: list[int], seq_lens: list[int], block_tables: torch.Tensor | list[list[int]],
                  slot_mapping: list[int], prompt_rows=None, fill=None) -> torch.Tensor:
    """The one forward setup: a flat ragged batch (each sequence's `query_lens[i]` new tokens, `seq_lens[i]` tokens
    of context once they are in) through `model.forward` over `pool`; hidden states [T, hidden].

    `block_tables`: [B, width] int32 on the model's device (the engine's persistent batch), or lists (the draft
    model, the warm-up). `fill` writes token ids still on the device (model_runner.TokenFill).
    """
    dev = model.device
    if isinstance(block_tables, torch.Tensor):
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        meta = AttentionMetadata(slot_mapping=to_device(slot_mapping, torch.long, dev),
                                 query_start_loc=to_device(starts, torch.int32, dev),
                                 seq_lens=to_device(seq_lens, torch.int32, dev), block_tables=block_tables,
                                 max_query_len=max(query_lens), max_seq_len=max(seq_lens),
                                 query_lens_host=list(query_lens), seq_lens_host=list(seq_lens))
    else:
        meta = AttentionMetadata.build(query_lens, seq_lens, block_tables, slot_mapping, dev)
    ids = token_ids if isinstance(token_ids, torch.Tensor) else to_device(token_ids, torch.long, dev)
    if fill is not None:
        fill.apply(ids)
    pos = positions if isinstance(positions, torch.Tensor) else to_device(positions, torch.long, dev)
    return model.forward(ids, pos, PagedKVAttention(pool, meta), prompt_rows)
