"""CUDA graphs for decode steps: the decode-only forward (every sequence has one query token) captured once per
bucketed batch size, replayed with the step's values copied into static input buffers.

- Buckets: 1, 2, 4, 8, 16, 32, ... below `max_num_seqs`, then `max_num_seqs` itself (`graph_batch_sizes`). A step
  of n sequences runs the smallest bucket >= n; the n..bucket padding rows write their K/V to a scratch block the
  scheduler never hands out (the pool's last block), attend over that one slot (seq_len 1, so their output is
  finite), and their logits are dropped.
- Static buffers, sized for the largest bucket: token ids, positions, slot mapping, seq lens, block tables padded
  to the most blocks a sequence can have (`max_model_len / block_size`), and query_start_loc = 0..B.
- The attention inside the graph is the Triton flash-decoding kernel, launched with `max_seq_len` fixed to
  `max_model_len` (an upper bound of every seq_len), so its split layout does not depend on the step; nothing in the
  captured region reads a host list or a device value on the host. Graphs are used only where dispatch picks
  Triton on a CUDA device; prefill and mixed steps, speculative verification, CPU and `--eager` run eagerly.
- With `capture=False` the same bookkeeping (bucketing, padding, static buffers, the scratch block) runs eagerly on
  any device: that is how it is tested without a GPU, and what `--eager` skips entirely.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from edgeserve.kernels.dispatch import use_triton
from edgeserve.kernels.paged_attention import AttentionMetadata
from edgeserve.kernels.transfer import to_device
from edgeserve.models.config import ModelConfig
from edgeserve.models.llama import LlamaModel

from .kv_cache import KVPool, PagedKVAttention

if TYPE_CHECKING:
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
    model whose attention takes the Triton decode kernel (head_dim <= 256, whole query groups per KV head); the torch
    twin of attention plans on the host and cannot be captured."""
    if device.type != "cuda" or not use_triton(device):
        return False
    return config is None or (config.head_dim <= 256 and config.num_heads % config.num_kv_heads == 0)


@dataclass
class PaddedDecode:
    """One decode step padded to a bucket, as host lists (row i < n is sequence i, the rest are padding)."""

    n: int
    bucket: int
    token_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]  # each exactly max_blocks long


def pad_decode_batch(token_ids: list[int], positions: list[int], slot_mapping: list[int], seq_lens: list[int],
                     block_tables: list[list[int]] | None, bucket: int, max_blocks: int, scratch_block: int,
                     block_size: int) -> PaddedDecode:
    """Pad a decode step of n = len(token_ids) sequences up to `bucket` rows.

    Padding rows: token 0 at position 0, written to the scratch block's first slot, attending to that slot only
    (seq_len 1, block table [scratch_block, 0, ...]). Every block table is padded with 0 to `max_blocks`; with
    `block_tables` None (the engine's path: its tables are already tensors) no tables are built.
    """
    n = len(token_ids)
    if not n <= bucket:
        raise ValueError(f"{n} sequences do not fit a batch of {bucket}")
    pad = bucket - n
    scratch_slot = scratch_block * block_size
    tables = []
    if block_tables is not None:
        if any(len(t) > max_blocks for t in block_tables):
            raise ValueError(f"a block table is longer than {max_blocks} blocks")
        tables = [list(t) + [0] * (max_blocks - len(t)) for t in block_tables]
        tables += [[scratch_block] + [0] * (max_blocks - 1) for _ in range(pad)]
    return PaddedDecode(n, bucket, list(token_ids) + [0] * pad, list(positions) + [0] * pad,
                        list(slot_mapping) + [scratch_slot] * pad, list(seq_lens) + [1] * pad, tables)


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

    def prepare(self, token_ids: list[int], positions: list[int], slot_mapping: list[int], seq_lens: list[int],
                block_tables: torch.Tensor) -> PaddedDecode:
        """Pad the step to its bucket and copy it into the static buffers; `block_tables` [n, width] (the
        persistent batch's, on the device) fill the first `width` columns of the table buffer, device to device
        (columns past a row's blocks are never read: its length bounds it)."""
        n = len(token_ids)
        bucket = bucket_for(n, self.sizes)
        assert bucket is not None
        self.pool.sync_window_map()  # the sliding-window pool's block pairing, read by the captured graph
        p = pad_decode_batch(token_ids, positions, slot_mapping, seq_lens, None, bucket, self.max_blocks,
                             self.pool.scratch_block, self.block_size)
        dev = self.device
        self.ids[:bucket].copy_(to_device(p.token_ids, torch.long, dev))
        self.positions[:bucket].copy_(to_device(p.positions, torch.long, dev))
        self.slots[:bucket].copy_(to_device(p.slot_mapping, torch.long, dev))
        self.seq_lens[:bucket].copy_(to_device(p.seq_lens, torch.int32, dev))
        self.tables[:n, : block_tables.shape[1]].copy_(block_tables)
        self.tables[n:bucket, 0] = self.pool.scratch_block  # padding rows read the scratch block only
        return p

    def run(self, token_ids: list[int], positions: list[int], slot_mapping: list[int], seq_lens: list[int],
            block_tables: torch.Tensor, fill: "TokenFill | None" = None) -> torch.Tensor:
        """Float32 logits [n, vocab] of a decode step of n sequences (row i: sequence i's one token); `fill`
        supplies token ids still on the device (see model_runner.TokenFill)."""
        p = self.prepare(token_ids, positions, slot_mapping, seq_lens, block_tables)
        if fill is not None:
            fill.apply(self.ids)
        if self.capture:
            self.graphs[p.bucket].replay()
            self.replays += 1
            return self.outputs[p.bucket][: p.n]
        self.eager_runs += 1
        return self._forward(p.bucket, p.seq_lens)[: p.n]
