"""The persistent input batch: each running sequence's block table kept in one preallocated tensor on the model's
device, updated in place as the sequence gains blocks, loses them (speculative rollback) or leaves; and the step's
flat inputs (token ids, positions, KV slots, query starts, context lengths) written in place into preallocated host
buffers (pinned on CUDA) and sent to the device in one copy.

A step then reads its block tables as a slice (or one gather) of that tensor: no whole-table copy from Python lists
and no padding to the longest context; its positions are computed from each sequence's start in three vectorized
ops; so the host's work per step grows with the tokens it computes, never with the sequences' history.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from edgeserve.kernels.transfer import to_device

if TYPE_CHECKING:
    from ..sched.scheduler import ScheduledSeq


@dataclass
class StepInputs:
    """One step's flat ragged inputs on the model's device (views of the batch's buffers: read them during this
    step only)."""

    token_ids: torch.Tensor  # [T] int64 (placeholders of tokens still on the device are -1 until TokenFill)
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: each token's KV slot
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32: tokens with KV once the step is done
    block_tables: torch.Tensor  # [B, width] int32
    query_lens: list[int]  # [B] on the host
    seq_lens_host: list[int]  # [B] on the host


class _Buffers:
    """A step's packed inputs: int64 (token ids, positions, slots: 3 per token) and int32 (query starts, then
    lengths: 2 per sequence + 1), on the host (pinned on CUDA; with numpy views to write them) or the device; and
    the tensor views of one step's layout, kept per (tokens, sequences) so a run of like steps slices nothing."""

    def __init__(self, num_tokens: int, num_seqs: int, device: torch.device, pin: bool = False) -> None:
        self.i64 = torch.zeros(3 * num_tokens, dtype=torch.int64, device=device, pin_memory=pin)
        self.i32 = torch.zeros(2 * num_seqs + 1, dtype=torch.int32, device=device, pin_memory=pin)
        if device.type == "cpu":
            self.a64, self.a32 = self.i64.numpy(), self.i32.numpy()
        self.event: torch.cuda.Event | None = None  # the last copy out of this (host) buffer
        self._views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def fits(self, n: int, b: int) -> bool:
        return 3 * n <= self.i64.numel() and 2 * b + 1 <= self.i32.numel()

    def views(self, n: int, b: int) -> tuple[torch.Tensor, ...]:
        """(ids, positions, slots, query starts, lengths, all int64, all int32) of a step of n tokens, b sequences."""
        v = self._views.get((n, b))
        if v is None:
            if len(self._views) >= 64:  # prefill steps come in many shapes; keep the cache small
                self._views.clear()
            i64, i32 = self.i64, self.i32
            v = self._views[n, b] = (i64[:n], i64[n:2 * n], i64[2 * n:3 * n], i32[:b + 1], i32[b + 1:2 * b + 1],
                                     i64[:3 * n], i32[:2 * b + 1])
        return v


class InputBatch:
    """Block-table rows by sequence id: `rows()` syncs each sequence's row (writing only its new blocks) and
    `tables()` gives the step's [B, width] int32 tables; `shrink()` / `remove()` follow rollback and retirement."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device | str,
                 max_num_tokens: int = 2048, rows: MutableMapping[Hashable, int] | None = None) -> None:
        """`rows`: where each sequence's row is kept (the engine's request registry, `Registry.view("batch_row")`);
        a map of its own without it."""
        self.device = torch.device(device)
        self.max_blocks = max_blocks_per_seq
        self.block_tables = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int32, device=self.device)
        self._row: MutableMapping[Hashable, int] = {} if rows is None else rows
        self._num_blocks: list[int] = [0] * max_num_seqs  # valid entries of each row
        self._free = list(range(max_num_seqs - 1, -1, -1))
        # two host buffers in turn: a step writes one while the other's copy to the device may still be queued
        self._pin = self.device.type == "cuda"
        self._host = [_Buffers(max_num_tokens, max_num_seqs, torch.device("cpu"), self._pin) for _ in range(2)]
        self._dev = (_Buffers(max_num_tokens, max_num_seqs, self.device) if self.device.type != "cpu" else None)
        self._turn = 0
        self._arange = np.arange(max_num_seqs + 1, dtype=np.int32)

    def __len__(self) -> int:
        return len(self._row)

    def sync(self, seq_id: Hashable, block_ids: Sequence[int]) -> int:
        """The row of `seq_id` with its table equal to `block_ids` (only blocks past the row's known ones are
        written: a sequence's blocks change only at the tail, and `shrink` / `remove` report the other changes)."""
        row = self._row.get(seq_id)
        if row is None:
            if not self._free:
                self._grow()
            row = self._row[seq_id] = self._free.pop()
            self._num_blocks[row] = 0
        known, n = self._num_blocks[row], len(block_ids)
        if n > known:
            if n > self.max_blocks:
                raise ValueError(f"a block table of {n} blocks is longer than the batch's {self.max_blocks}")
            self.block_tables[row, known:n] = to_device(block_ids[known:n], torch.int32, self.device)
        self._num_blocks[row] = n
        return row

    def shrink(self, seq_id: Hashable, num_blocks: int) -> None:
        """`seq_id` now holds only its first `num_blocks` blocks (its tail blocks went back to the pool)."""
        row = self._row.get(seq_id)
        if row is not None:
            self._num_blocks[row] = min(self._num_blocks[row], num_blocks)

    def remove(self, seq_id: Hashable) -> None:
        """Forget `seq_id` (finished, aborted or preempted): its row is free for the next sequence."""
        row = self._row.pop(seq_id, None)
        if row is not None:
            self._free.append(row)

    def tables(self, rows: list[int], width: int) -> torch.Tensor:
        """The [len(rows), width] block tables of these rows, in order: a view when they are 0..B-1, else one
        gather. Entries past a row's own blocks are stale block ids, never read (the lengths bound every read)."""
        width = max(1, width)
        if rows == list(range(len(rows))):
            return self.block_tables[: len(rows), :width]
        return self.block_tables[to_device(rows, torch.long, self.device), :width]

    def prepare(self, scheduled: list["ScheduledSeq"]) -> StepInputs:
        """The step's inputs on the device: each sequence's row synced, its tokens, positions and slots written in
        place into a host buffer and sent in one copy per dtype (on CPU the buffer's own views: no copy at all)."""
        rows = [self.sync(s.seq_id, s.block_table) for s in scheduled]
        tables = self.tables(rows, max(len(s.block_table) for s in scheduled))
        query_lens = [s.num_new_tokens for s in scheduled]
        seq_lens = [s.context_len for s in scheduled]
        n, b = sum(query_lens), len(scheduled)
        host = self._next_host(n, b)
        a, q = host.a64, host.a32
        if n == b:  # one token each (decodes): a sequence's position is its context length less one
            a[:n] = [s.token_ids[0] for s in scheduled]
            a[n:2 * n] = seq_lens
            a[n:2 * n] -= 1
            a[2 * n:3 * n] = [s.slot_mapping[0] for s in scheduled]
            if b >= len(self._arange):
                self._arange = np.arange(2 * b + 1, dtype=np.int32)
            q[:b + 1] = self._arange[:b + 1]
        else:  # each sequence's run start..end-1: its start repeated, plus the token's offset in its run
            a[:n] = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in scheduled), np.int64, n)
            lens = np.asarray(query_lens)
            q[0] = 0
            np.cumsum(lens, out=q[1:b + 1])
            a[n:2 * n] = np.repeat(np.asarray(seq_lens) - lens - q[:b], lens) + np.arange(n)
            a[2 * n:3 * n] = np.fromiter(itertools.chain.from_iterable(s.slot_mapping for s in scheduled),
                                         np.int64, n)
        q[b + 1:2 * b + 1] = seq_lens
        views = host.views(n, b)
        if self._dev is not None:  # one copy per dtype, queued on the stream before this step's forward
            if not self._dev.fits(n, b):
                self._dev = _Buffers(2 * n, 2 * b, self.device)
            dev = self._dev.views(n, b)
            dev[5].copy_(views[5], non_blocking=True)
            dev[6].copy_(views[6], non_blocking=True)
            host.event = torch.cuda.Event()
            host.event.record()
            views = dev
        return StepInputs(*views[:5], tables, query_lens, seq_lens)

    def _next_host(self, n: int, b: int) -> _Buffers:
        """The next host buffer in turn, large enough, once its previous copy to the device is done."""
        self._turn ^= 1
        host = self._host[self._turn]
        if host.event is not None:
            host.event.synchronize()  # two steps old: long done unless the device is far behind
            host.event = None
        if not host.fits(n, b):
            host = self._host[self._turn] = _Buffers(2 * n, 2 * b, torch.device("cpu"), self._pin)
        return host

    def _grow(self) -> None:
        old = self.block_tables.shape[0]
        self.block_tables = torch.cat([self.block_tables, torch.zeros_like(self.block_tables)])
        self._num_blocks += [0] * old
        self._free = list(range(2 * old - 1, old - 1, -1))

