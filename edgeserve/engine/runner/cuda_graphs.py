"""CUDA graphs for decode steps: the decode-only forward (every sequence has one query token) captured once per
bucketed batch size, replayed with the step's values copied into static input buffers.

- Buckets: 1, 2, 4, 8, 16, 32, ... below `max_num_seqs`, then `max_num_seqs` itself (`graph_batch_sizes`). A step
  of n sequences runs the smallest bucket >= n; the n..bucket padding rows write their K/V to a scratch block the
  scheduler never hands out (the pool's last block), attend over that one slot (seq_len 1, so their output is
  finite), and their logits are dropped.
- Static buffers, sized for the largest bucket: token ids, positions, slot mapping, seq lens, block tables padded
  to the most blocks a sequence can have (`max_model_len / block_size`), and query_start_loc = 0..B. A step's
  inputs (the persistent batch's, already on the device) are copied in device to device; padding is written there.
- The attention inside the graph is the Triton flash-decoding kernel, launched with `max_seq_len` fixed to
  `max_model_len` (an upper bound of every seq_len), so its split layout does not depend on the step; nothing in the
  captured region reads a host list or a device value on the host. Graphs are used only where dispatch picks
  Triton on a CUDA device; prefill and mixed steps, speculative verification, CPU and `--eager` run eagerly.
- With `capture=False` the same bookkeeping (bucketing, padding, static buffers, the scratch block) runs eagerly on
  any device: that is how it is tested without a GPU, and what `--eager` skips entirely.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from edgeserve.kernels.dispatch import use_triton
from edgeserve.kernels.torch.paged_attention import AttentionMetadata
from edgeserve.models.config import ModelConfig
from edgeserve.models.llama import LlamaModel

from ..cache.kv_cache import KVPool, PagedKVAttention

if TYPE_CHECKING:
    from .input_batch import StepInputs
    from .model_runner import TokenFill

log = logging.getLogger("edgeserve.engine")


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The captured batch sizes: powers of two below max_num_seqs, then max_num_seqs."""
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    sizes.append(max_num_seqs)
    return sizes


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds n sequences (None: more than the largest)."""
    for s in sizes:
        if s >= n:
            return s
    return None


def graphs_supported(device: torch.device, config: ModelConfig | None = None) -> bool:
    """Whether decode steps can be captured here: a CUDA device on which dispatch runs the Triton kernels, for a
    model whose attention takes the Triton decode kernel (head_dim <= 256 on every layer, whole query groups per KV
    head); the torch twin of attention plans on the host and cannot be captured. Not for Mixture-of-Experts models:
    their layers group each step's rows by expert on the host; nor hybrids (their recurrent-state batch is built on
    the host each step)."""
    if device.type != "cuda" or not use_triton(device):
        return False
    if config is None:
        return True
    return not config.is_moe and not config.is_hybrid and all(  # Gemma 4's global layers have heads of their own
        config.layer_head_dim(i) <= 256 and config.num_heads % config.layer_kv_heads(i) == 0
        for i in range(config.num_layers))


class DecodeGraphs:
    """Static buffers and one captured graph per bucket; `run()` a decode step and get its float32 logits."""

    def __init__(self, model: LlamaModel, pool: KVPool, max_num_seqs: int, max_model_len: int,
                 capture: bool = True) -> None:
        if pool.scratch_block is None:
            raise ValueError("decode graphs need a KV pool with a scratch block (KVPool(..., scratch_block=True))")
        self.model = model
        self.pool = pool
        self.device = model.device
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.block_size = pool.block_size
        self.max_blocks = -(-max_model_len // pool.block_size)
        b, dev = self.sizes[-1], self.device
        self.ids = torch.zeros(b, dtype=torch.long, device=dev)
        self.positions = torch.zeros(b, dtype=torch.long, device=dev)
        self.slots = torch.full((b,), pool.scratch_block * pool.block_size, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(b, dtype=torch.int32, device=dev)
        self.tables = torch.zeros(b, self.max_blocks, dtype=torch.int32, device=dev)
        self.tables[:, 0] = pool.scratch_block
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.capture = capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0  # decode steps served by a captured graph
        self.eager_runs = 0  # decode steps served through the static buffers without a graph (capture=False)
        if capture:
            self._capture_all()

    # --- metadata over the static buffers ------------------------------------------------------------------
    def _meta(self, bucket: int, seq_lens_host: list[int] | None = None) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[:bucket], query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket], block_tables=self.tables[:bucket], max_query_len=1,
            # a fixed upper bound: the Triton decode kernel's split layout depends only on the bucket
            max_seq_len=self.max_model_len,
            query_lens_host=[1] * bucket,
            # host lengths exist only for the torch reference, which runs only without capture
            seq_lens_host=seq_lens_host if seq_lens_host is not None else [self.max_model_len] * bucket)

    def _forward(self, bucket: int, seq_lens_host: list[int] | None = None) -> torch.Tensor:
        attn = PagedKVAttention(self.pool, self._meta(bucket, seq_lens_host))
        hidden = self.model.forward(self.ids[:bucket], self.positions[:bucket], attn)
        return self.model.logits(hidden)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Capture every bucket, largest first, into one memory pool (buffers hold padding: scratch slot only)."""
        pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize(self.device)
        for bucket in reversed(self.sizes):
            self._forward(bucket)  # warm-up outside the capture: Triton compiles here, allocator settles
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self._forward(bucket)
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    # --- running a step ------------------------------------------------------------------------------------
    def can_run(self, query_lens: list[int], table_width: int | None = None) -> bool:
        """Whether a step is a decode step that fits a bucket (and, given its block tables' width, the table
        buffer)."""
        if not query_lens or len(query_lens) > self.sizes[-1] or any(n != 1 for n in query_lens):
            return False
        return table_width is None or table_width <= self.max_blocks

    def prepare(self, inputs: "StepInputs") -> int:
        """Copy a decode step of n sequences into the static buffers (device to device: they take a slice of the
        persistent batch's inputs) and pad it to its bucket; returns the bucket. Padding rows: token 0 at position
        0, written to the scratch block's first slot, attending to that slot only (seq_len 1, table [scratch]).
        The step's tables fill the first `width` columns (columns past a row's blocks are never read)."""
        n = len(inputs.query_lens)
        bucket = bucket_for(n, self.sizes)
        assert bucket is not None
        self.pool.sync_window_map()  # the sliding-window pool's block pairing, read by the captured graph
        self.ids[:n].copy_(inputs.token_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slots[:n].copy_(inputs.slot_mapping)
        self.seq_lens[:n].copy_(inputs.seq_lens)
        self.tables[:n, : inputs.block_tables.shape[1]].copy_(inputs.block_tables)
        if bucket > n:
            self.ids[n:bucket] = 0
            self.positions[n:bucket] = 0
            self.slots[n:bucket] = self.pool.scratch_block * self.block_size
            self.seq_lens[n:bucket] = 1
            self.tables[n:bucket, 0] = self.pool.scratch_block  # padding rows read the scratch block only
        return bucket

    def run(self, inputs: "StepInputs", fill: "TokenFill | None" = None) -> torch.Tensor:
        """Float32 logits [n, vocab] of a decode step of n sequences (row i: sequence i's one token); `fill`
        supplies token ids still on the device (see model_runner.TokenFill)."""
        n = len(inputs.query_lens)
        bucket = self.prepare(inputs)
        if fill is not None:
            fill.apply(self.ids)
        if self.capture:
            self.graphs[bucket].replay()
            self.replays += 1
            return self.outputs[bucket][:n]
        self.eager_runs += 1
        return self._forward(bucket, inputs.seq_lens_host + [1] * (bucket - n))[:n]
