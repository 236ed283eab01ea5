"""The persistent input batch: each running sequence's block table kept in one preallocated tensor on the model's
device, updated in place as the sequence gains blocks, loses them (speculative rollback) or leaves.

A step then reads its block tables as a slice (or one gather) of that tensor: no whole-table copy from Python lists
and no padding to the longest context, so the host's work per step does not grow with the context length.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from edgeserve.kernels.transfer import to_device


class InputBatch:
    """Block-table rows by sequence id: `rows()` syncs each sequence's row (writing only its new blocks) and
    `tables()` gives the step's [B, width] int32 tables; `shrink()` / `remove()` follow rollback and retirement."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.max_blocks = max_blocks_per_seq
        self.block_tables = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int32, device=self.device)
        self._row: dict[Hashable, int] = {}
        self._num_blocks: list[int] = [0] * max_num_seqs  # valid entries of each row
        self._free = list(range(max_num_seqs - 1, -1, -1))

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

    def _grow(self) -> None:
        old = self.block_tables.shape[0]
        self.block_tables = torch.cat([self.block_tables, torch.zeros_like(self.block_tables)])
        self._num_blocks += [0] * old
        self._free = list(range(2 * old - 1, old - 1, -1))
