"""The KV pool's memory: one K and one V tensor per model, blocks of `block_size` slots, sized from a budget.

A model that mixes sliding-window and global layers (Gemma 2/3) can keep the sliding layers' K/V apart, in a
smaller pool whose blocks a sequence holds only within its window (`edgeserve.engine.cache.window_blocks`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from edgeserve.kernels.dispatch import AttentionMetadata, paged_attention, write_kv
from edgeserve.kernels.transfer import to_device
from edgeserve.models.config import ModelConfig

from .kv_budget import KVBudget, default_cpu_budget, explicit_why, gpu_budget_why
from .cache_spec import kv_owners, kv_source, layer_caches
from .kv_format import KVFormat, as_kv_format, resolve_kv_format

if TYPE_CHECKING:
    from ..runner.input_batch import StepInputs
    from .state_cache import StateBudget


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype | KVFormat) -> int:
    """Bytes of K and V one token takes over all layers that keep their own (not Gemma 4's KV-shared layers), in
    the pool's float dtype or KV format (q8_0: 34 bytes per 32 values)."""
    return sum(layer_kv_bytes(config, dtype, i) for i in kv_owners(config))


def layer_kv_bytes(config: ModelConfig, dtype: torch.dtype | KVFormat, layer: int) -> int:
    """Bytes of K and V one token takes in `layer`."""
    c = layer_caches(config)[layer]
    return 2 * c.kv_heads * as_kv_format(dtype).row_bytes(c.head_dim)


def free_memory_bytes(device: torch.device) -> int:
    """Memory free for the KV pool now: the device's free memory on CUDA, available RAM elsewhere."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def num_blocks_for_budget(budget_bytes: float, config: ModelConfig, dtype: torch.dtype | KVFormat,
                          block_size: int) -> int:
    """How many blocks of `block_size` tokens fit in `budget_bytes`."""
    return int(budget_bytes // (kv_bytes_per_token(config, dtype) * block_size))


def split_window(config: ModelConfig) -> int | None:
    """The sliding window of a model whose layers mix one window size with global attention (their K/V can live in
    a window pool); None otherwise."""
    windows = {c.window for c in layer_caches(config) if c.owns_kv}
    if None not in windows or len(windows) != 2:
        return None
    return next(w for w in windows if w is not None)


def window_pool_blocks(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Window blocks that can never run out: each running sequence holds the blocks its window covers (at most
    window / block_size + 2) plus those of this step's tokens (all steps' tokens together: the token budget)."""
    return max_num_seqs * (-(-window // block_size) + 3) + -(-max_num_batched_tokens // block_size)


def pool_blocks_for_budget(budget_bytes: float, config: ModelConfig, dtype: torch.dtype | KVFormat, block_size: int,
                           max_num_seqs: int, max_num_batched_tokens: int) -> tuple[int, int]:
    """(main blocks, window blocks) that fit in `budget_bytes`: window blocks 0 when the model has no window pool;
    else the window pool takes what can never run out (`window_pool_blocks`) and the global layers the rest, or
    both pools get the same count when that leaves the global layers fewer blocks."""
    window = split_window(config)
    unsplit = num_blocks_for_budget(budget_bytes, config, dtype, block_size)
    if window is None:
        return unsplit, 0
    window_token = sum(layer_kv_bytes(config, dtype, i) for i, c in enumerate(layer_caches(config))
                       if c.kind == "window")
    main_token = kv_bytes_per_token(config, dtype) - window_token
    window_blocks = window_pool_blocks(window, block_size, max_num_seqs, max_num_batched_tokens)
    left = budget_bytes - window_blocks * block_size * window_token
    main = int(left // (main_token * block_size)) if main_token else unsplit
    if main <= max(unsplit, window_blocks):
        return unsplit, unsplit
    return main, window_blocks


class KVPool:
    """K and V for every layer: [num_layers, num_blocks, block_size, num_kv_heads, head_dim] each, zeroed; in a
    quantized KV format (`kv_format`) the last dimension is a head row's storage (q8_0: uint8, head_dim / 32 * 34;
    fp8: float8_e4m3fn, head_dim + 4 with the row's float32 scale).

    Layers that read another layer's K/V (Gemma 4's KV-shared layers, `ModelConfig.kv_source`) get no memory:
    `layer_slot` sends them to their source's. Sliding layers whose K/V heads differ in shape from the global ones
    (Gemma 4) are kept in `window_k` / `window_v` even without a window pool, under the main pool's block ids.

    With `window_blocks` (a model of sliding and global layers, see `split_window`), `k` / `v` hold the global
    layers only and `window_k` / `window_v` the sliding ones, [num_sliding_layers, window_blocks, ...]; `layer_slot`
    says where each layer lives. `attach` hands the window pool's bookkeeping to the scheduler's BlockManager.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype | KVFormat,
                 device: torch.device | str = "cpu", scratch_block: bool = False, window_blocks: int = 0) -> None:
        """`dtype`: the values' float dtype or a KV format (engine.cache.kv_format); `scratch_block`: one more block after
        the `num_blocks` the scheduler owns, where the padding rows of a CUDA-graph decode batch write (its id is
        `self.scratch_block`; None without one)."""
        self.kv_format = fmt = as_kv_format(dtype)
        dtype = fmt.storage
        self.scratch_block: int | None = num_blocks if scratch_block else None
        extra = 1 if scratch_block else 0
        self.window = split_window(config) if window_blocks > 0 else None
        caches = layer_caches(config)  # what each layer keeps
        owners = kv_owners(config)
        sliding = [i for i in owners if caches[i].kind == "window"]
        global_ = [i for i in owners if caches[i].kind == "full"]
        shapes = {(caches[i].kv_heads, caches[i].head_dim) for i in owners}
        # the sliding layers live apart in their own window pool, or (Gemma 4) for their own K/V head shape
        apart = bool(sliding) and (self.window is not None or len(shapes) > 1)
        if not apart:
            global_, sliding = owners, []
        # layer i -> (kept with the sliding layers, its index there); a KV-shared layer reads its source's slot; a
        # linear-attention layer has none
        own = {i: (False, global_.index(i)) if i in global_ else (True, sliding.index(i)) for i in owners}
        self.layer_slot = [own.get(kv_source(caches, i)) for i in range(config.num_layers)]

        def tail(layers: list[int]) -> tuple[int, int, int]:
            heads, dim = (caches[layers[0]].kv_heads, caches[layers[0]].head_dim) if layers else \
                (config.num_kv_heads, config.head_dim)
            return block_size, heads, fmt.row_width(dim) if layers else dim

        if len({tail([i]) for i in global_}) > 1 or len({tail([i]) for i in sliding}) > 1:
            raise ValueError("layers of one kind (sliding or global) with different K/V head shapes")
        # zeroed, not empty: attention reads padded slots with weight 0, and 0 * NaN garbage would be NaN
        self.k = torch.zeros((len(global_), num_blocks + extra, *tail(global_)), dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.window_blocks = window_blocks if self.window is not None else 0
        # without a window pool, sliding layers kept apart (for their shape) use the main pool's block ids
        sliding_blocks = self.window_blocks if self.window is not None else num_blocks
        self.window_k = torch.zeros((len(sliding), sliding_blocks + extra if sliding else extra, *tail(sliding)),
                                    dtype=dtype, device=device)
        self.window_v = torch.zeros_like(self.window_k)
        # main block -> window block, on the model's device (synced from the BlockManager each step); the scratch
        # block's entry is the window pool's scratch block
        self.window_map: torch.Tensor | None = None
        self._window_of = None
        self.num_blocks = num_blocks
        self.block_size = block_size

    @property
    def kv_dtype(self) -> str:
        """The KV format's name (bf16, f16, f32, q8_0, fp8), as /metrics and /api/ps show it."""
        return self.kv_format.name

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.window_k.nbytes + self.window_v.nbytes

    def attach(self, block_manager) -> None:
        """Give `block_manager` (the scheduler's) this pool's block copy and window pool to keep."""
        block_manager.copy_block = self.copy_block
        if self.window is None:
            return
        wb = block_manager.use_window(self.window, self.window_blocks)
        self._window_of = wb.of_block
        host = torch.frombuffer(wb.of_block, dtype=torch.int32)
        if self.k.device.type == "cpu" and self.scratch_block is None:
            self.window_map = host  # shares the BlockManager's memory: always current
        else:
            self.window_map = torch.full((self.k.shape[1],), self.window_blocks, dtype=torch.int32,
                                         device=self.k.device)
            self.sync_window_map()

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block `src`'s K and V, every layer, into block `dst` (a partly matching prefix is reused this way)."""
        self.k[:, dst].copy_(self.k[:, src])
        self.v[:, dst].copy_(self.v[:, src])
        if self.window is None and self.window_k.shape[0]:  # sliding layers apart for their shape, same block ids
            self.window_k[:, dst].copy_(self.window_k[:, src])
            self.window_v[:, dst].copy_(self.window_v[:, src])

    def sync_window_map(self) -> None:
        """Copy the BlockManager's pairing of main and window blocks to the device (before a step runs; a no-op
        where the map is shared or there is no window pool). Not during a CUDA graph capture."""
        if self._window_of is None or (self.window_map.device.type == "cpu" and self.scratch_block is None):
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return
        self.window_map[: self.num_blocks].copy_(torch.frombuffer(self._window_of, dtype=torch.int32))


class PagedKVAttention:
    """The model's KVAttention for one step: writes the step's K/V to its slots and attends through block tables."""

    def __init__(self, pool: KVPool, meta: AttentionMetadata, scale: float | None = None, states=None) -> None:
        """`states`: the step's recurrent states (engine.cache.state_pool.StepStates) for a hybrid model's linear layers."""
        self.pool = pool
        self.meta = meta
        self.scale = scale
        self.states = states
        self._window_meta: AttentionMetadata | None = None
        self._causal_metas: dict[int, AttentionMetadata] = {}  # a metadata's copy without its spans, by its id
        pool.sync_window_map()

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache, slots = self.layer_cache(layer)
        write_kv(k_cache, v_cache, k, v, slots)
        return self.attend(layer, q)

    def layer_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One layer's K and V pool and the slot of each of this step's tokens (for a fused RoPE + K/V write)."""
        k, v, meta = self._layer(layer)
        return k, v, meta.slot_mapping

    def attend(self, layer: int, q: torch.Tensor, window: int | None = None, softcap: float | None = None,
               scale: float | None = None, sinks: torch.Tensor | None = None, spans: bool = True) -> torch.Tensor:
        """Attention of q [T, H, D] over this layer's pool, this step's K/V already written: [T, H * D].
        `window`: a sliding-window layer; `softcap`: attention-logit soft-capping; `scale`: overrides the pool's;
        `sinks`: float32 [H] attention sinks (gpt-oss); `spans` False: causal even over the step's bidirectional
        spans (Gemma 4's global layers)."""
        k, v, meta = self._layer(layer)
        if not spans and meta.attend_spans is not None:
            meta = self._causal(meta)
        return paged_attention(q, k, v, meta, self.scale if scale is None else scale, window,
                               softcap, sinks).reshape(q.shape[0], -1)

    def _layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Where layer `layer` keeps its K/V and the step's metadata over that pool."""
        sliding, j = self.pool.layer_slot[layer]
        if not sliding:
            return self.pool.k[j], self.pool.v[j], self.meta
        if self.pool.window is None:  # kept apart for their K/V shape only: the main pool's block ids
            return self.pool.window_k[j], self.pool.window_v[j], self.meta
        return self.pool.window_k[j], self.pool.window_v[j], self.window_meta()

    def _causal(self, meta: AttentionMetadata) -> AttentionMetadata:
        """`meta` without its bidirectional spans, with its own per-step plans (the kernels cache them on it)."""
        if id(meta) not in self._causal_metas:
            self._causal_metas[id(meta)] = dataclasses.replace(meta, attend_spans=None, torch_plan=None,
                                                               native_rows=None, torch_window_plans={})
        return self._causal_metas[id(meta)]

    def window_meta(self) -> AttentionMetadata:
        """The step's metadata over the sliding-window pool (block tables and slots of its blocks), made once."""
        if self._window_meta is None:
            self._window_meta = window_metadata(self.meta, self.pool.window_map, self.pool.block_size)
        return self._window_meta


def window_metadata(meta: AttentionMetadata, window_map: torch.Tensor, block_size: int) -> AttentionMetadata:
    """`meta` over the window pool: block tables and slots through the main-to-window block map (blocks a window
    has left behind map to block 0, which the window's mask never reads)."""
    tables = window_map[meta.block_tables.long()].clamp_(min=0)
    slots = meta.slot_mapping
    window_slots = window_map[slots // block_size].long() * block_size + slots % block_size
    return dataclasses.replace(meta, slot_mapping=window_slots, block_tables=tables, torch_plan=None,
                               native_rows=None, torch_window_plans={})


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
    states = None
    if config.is_hybrid:  # one throwaway recurrent state for the warm-up sequence
        from .state_pool import StatePool, StepStates, state_spec_for

        one = StatePool(state_spec_for(config), 1, dev)
        states = StepStates.build(one, torch.tensor([0, num_tokens], device=dev), torch.tensor([one.allocate()],
                                                                                               device=dev))
    hidden = forward_batch(model, pool, ids, positions, [num_tokens], [num_tokens], [list(range(num_blocks))],
                           list(range(num_tokens)), states=states)
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
    warm-up forward at the largest step (weights included; experts that --cpu-moe-layers keeps in host memory are
    not device allocations, so they take nothing from the pool); see `edgeserve.device.gpu_kv_budget`."""
    from edgeserve.device import gpu_kv_budget

    peak = warmup_peak_bytes(model, config, num_tokens, num_rows, block_size)
    free, total = torch.cuda.mem_get_info(model.device)
    return gpu_kv_budget(int(total), int(free), int(torch.cuda.memory_reserved(model.device)), peak, fraction)


def engine_kv_format(lm, config) -> KVFormat:
    """The KV format of an engine's pool: `config.kv_cache_dtype` for its model and device (ValueError where that
    cannot run there)."""
    return resolve_kv_format(config.kv_cache_dtype, lm.config, lm.model.dtype, lm.model.device)


def pool_budget(lm, config, max_model_len: int) -> KVBudget:
    """The KV pool's byte budget and why: `kv_cache_gb`, else what the GPU memory fraction leaves after the weights
    and a warm-up step, else on a CPU room for a few full-context requests within a fraction of free memory
    (engine.cache.kv_budget; a hybrid model, whose recurrent states share the budget, takes that fraction)."""
    model = lm.model
    if config.kv_cache_gb:
        return KVBudget(int(config.kv_cache_gb * 2**30), explicit_why())
    if model.device.type == "cuda":
        return KVBudget(gpu_pool_budget(model, lm.config, min(config.max_num_batched_tokens, max_model_len),
                                        config.max_num_seqs, config.block_size, config.gpu_memory_fraction),
                        gpu_budget_why(config.gpu_memory_fraction))
    free = free_memory_bytes(model.device)
    if lm.config.is_hybrid:
        return KVBudget(int(config.kv_cache_fraction * free), f"{config.kv_cache_fraction:.0%} of the memory free "
                        "(the recurrent states share it); --kv-cache-gb sets it")
    return default_cpu_budget(kv_bytes_per_token(lm.config, engine_kv_format(lm, config)), max_model_len,
                              config.max_num_seqs, free, config.kv_cache_fraction)


def size_pool(lm, config) -> tuple[int, int, int, "StateBudget | None", KVBudget]:
    """(KV blocks, sliding-window pool blocks, usable context, recurrent-state slots, budget) of one engine: the
    budget (`pool_budget`) in blocks (`pool_blocks_for_budget`), no more than every seat filled to the full context;
    the context shrinks to what the pool holds. A hybrid model's recurrent-state seats and snapshots
    (engine.cache.state_cache.state_budget) come out of the same budget first (None for other models). ValueError when no
    block fits."""
    model = lm.model
    max_model_len = min(config.max_model_len or model.max_positions, model.max_positions)
    plan = pool_budget(lm, config, max_model_len)
    budget = plan.nbytes
    states = None
    if lm.config.is_hybrid:
        from .state_cache import state_budget
        from .state_pool import state_spec_for

        states = state_budget(state_spec_for(lm.config), budget, config.max_num_seqs,
                              config.enable_prefix_caching, speculative=config.speculative is not None)
        budget -= states.nbytes
    fmt = engine_kv_format(lm, config)
    num_blocks, window_blocks = pool_blocks_for_budget(budget, lm.config, fmt, config.block_size,
                                                       config.max_num_seqs, config.max_num_batched_tokens)
    blocks_per_seq = -(-max_model_len // config.block_size)
    num_blocks = min(num_blocks, blocks_per_seq * config.max_num_seqs)
    if num_blocks < 1:
        need = kv_bytes_per_token(lm.config, fmt) * config.block_size
        hint = (" (the GPU is full after the weights and a warm-up step: raise --gpu-memory-fraction or lower "
                "--max-batched-tokens)" if model.device.type == "cuda" and not config.kv_cache_gb else "")
        raise ValueError(f"the KV cache budget of {budget / 2**20:.1f} MiB holds no block of "
                         f"{need / 2**20:.2f} MiB{hint}")
    if num_blocks < blocks_per_seq:  # a request may not use more context than the pool holds
        max_model_len = num_blocks * config.block_size
    return num_blocks, window_blocks, max_model_len, states, plan


def forward_batch(model, pool: "KVPool", token_ids: torch.Tensor | list[int], positions: torch.Tensor | list[int],
                  query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                  slot_mapping: list[int], prompt_rows=None, states=None) -> torch.Tensor:
    """A flat ragged batch given as host lists (each sequence's `query_lens[i]` new tokens, `seq_lens[i]` tokens
    of context once they are in) through `model.forward` over `pool`; hidden states [T, hidden]. For the draft
    model and the warm-up; the engine's steps come through `forward_inputs` from its persistent batch."""
    dev = model.device
    meta = AttentionMetadata.build(query_lens, seq_lens, block_tables, slot_mapping, dev)
    ids = token_ids if isinstance(token_ids, torch.Tensor) else to_device(token_ids, torch.long, dev)
    pos = positions if isinstance(positions, torch.Tensor) else to_device(positions, torch.long, dev)
    return model.forward(ids, pos, PagedKVAttention(pool, meta, states=states), prompt_rows)


def forward_inputs(model, pool: "KVPool", inputs: "StepInputs", prompt_rows=None, fill=None,
                   states=None, lora=None, image_rows=None, mrope=None, spans=None) -> torch.Tensor:
    """One engine step's inputs (the persistent batch's, on the device) through `model.forward` over `pool`;
    hidden states [T, hidden]. `fill` writes token ids still on the device (model_runner.TokenFill); `states`: the
    step's recurrent states (state_pool.StepStates) for a hybrid model; `lora`: the step's LoRA adapters
    (models.lora_step.StepLora; only a decoder that takes adapters gets one); `image_rows`: (flat indices, rows)
    whose embeddings images replace (model_runner.image_rows), passed only when set; `mrope`: the step's positions
    with M-RoPE's offsets and, where image tokens are in it, their [3, T] positions (model_runner.step_mrope);
    `spans`: each sequence's bidirectional prompt spans (model_runner.step_spans, AttentionMetadata.attend_spans)."""
    meta = AttentionMetadata(slot_mapping=inputs.slot_mapping, query_start_loc=inputs.query_start_loc,
                             seq_lens=inputs.seq_lens, block_tables=inputs.block_tables,
                             max_query_len=max(inputs.query_lens), max_seq_len=max(inputs.seq_lens_host),
                             query_lens_host=inputs.query_lens, seq_lens_host=inputs.seq_lens_host,
                             attend_spans=spans)
    if fill is not None:
        fill.apply(inputs.token_ids)
    attn = PagedKVAttention(pool, meta, states=states)
    positions, extra = inputs.positions, {}
    if lora is not None:
        extra["lora"] = lora
    if image_rows is not None:
        extra["image_rows"] = image_rows
    if mrope is not None:
        positions = mrope[0]
        if mrope[1] is not None:
            extra["mrope_positions"] = mrope[1]
    return model.forward(inputs.token_ids, positions, attn, prompt_rows, **extra)
