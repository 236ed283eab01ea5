"""Disk tier: one checksummed file per KV block under `root/<layout key>/`, an LRU size budget, atomic writes.

The index is the directory itself: a restart lists the files (LRU order from their mtimes, which reads refresh)
and checks each file's prefix and size against the layout, so no separate index file can go stale; the whole block
is verified when it is read, or before a recomputed copy would be skipped as already stored. A file that fails
(truncated, bit-flipped, another model's, misnamed) is deleted and forgotten, reported as a miss, and the block is
written again the next time it is stored. Anything under a block's name that is not a regular file (a folder, a
symlink, a FIFO) is skipped, with one warning, and never replaced. Writes go
to a `.tmp-*` file first and are renamed into place, so a crash never leaves a half block under a block's
name; temp files are never read. Any I/O error while writing (full disk, unwritable path) turns the tier
off with one warning; callers just see misses.

A hybrid model's recurrent-state snapshots are files of their own beside the blocks (`<block hash>.kvs`: the
state after that block), under the same checks, budget, LRU and repair rules; the layout key includes the state
format, so a state is never read into a model whose state layers differ.

The budget covers every layout's files under `root` (other models' blocks are evicted too, oldest first).
Two processes sharing one folder each keep their own index; each stays within budget for what it sees.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import stat
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import json

import torch

from .block_file import (PREFIX_SIZE, CorruptBlockError, DecodedBlock, check_prefix, decode, decode_state, encode,
                         encode_state, file_size)
from .layout import KVLayout

log = logging.getLogger("edgeserve.offload")

SUFFIX = ".kvb"
STATE_SUFFIX = ".kvs"  # a hybrid model's recurrent-state snapshot after the block of the same name
TMP_PREFIX = ".tmp-"
STALE_TMP_SECONDS = 600  # older temp files are leftovers of a crash (younger ones may be another process's)
_LAYOUT_DIR = re.compile(r"^[0-9a-f]{32}$")
_BLOCK_NAME = re.compile(r"^[0-9a-f]{64}\.kv[bs]$")


@dataclass
class Records:
    """One kind of file of a layout (KV blocks or state snapshots): those on disk by block hash, those known whole
    (read back or written by this process), and the file name suffix."""

    dir: Path
    suffix: str
    own: dict[bytes, Path] = field(default_factory=dict)
    verified: set[bytes] = field(default_factory=set)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.own

    def __len__(self) -> int:
        return len(self.own)

    def whole(self, block_hash: bytes) -> bool:
        """Whether the record is on disk and known whole."""
        return block_hash in self.verified and block_hash in self.own

    def path(self, block_hash: bytes) -> Path:
        """Where the record for `block_hash` lives (whether or not it exists)."""
        return self.dir / f"{block_hash.hex()}{self.suffix}"


class DiskTier:
    """KV blocks of one layout on disk, under a byte budget shared with the other layouts in `root`."""

    def __init__(self, root: str | os.PathLike[str], layout: KVLayout, capacity_bytes: int, fsync: bool = False) -> None:
        self.root = Path(root)
        self.layout = layout
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync  # durability only: integrity comes from the checksum either way
        self.dir = self.root / layout.key
        self.enabled = True
        self.num_corrupt = 0
        self.used_bytes = 0
        self._files: OrderedDict[Path, int] = OrderedDict()  # every block file under root, LRU first -> size
        self._blocks = Records(self.dir, SUFFIX)  # this layout's blocks
        # this layout's state snapshots (hybrid models): `h in states`, states.whole(h), states.path(h), len(states)
        self.states = Records(self.dir, STATE_SUFFIX)
        self._skipped: set[Path] = set()  # block names held by something that is not a regular file
        self._warned_skipped = False
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._write_atomic(self.dir / "layout.json", [json.dumps(layout.describe(), indent=1).encode()])
            self._scan()
            self._evict_to(self.capacity_bytes)
        except OSError as e:
            self._disable(e)

    # --- queries ---------------------------------------------------------

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def verified(self, block_hash: bytes) -> bool:
        """Whether the block is on disk and known whole (read back or written by this process)."""
        return self._blocks.whole(block_hash)

    @property
    def num_blocks(self) -> int:
        """Blocks of this layout on disk (not yet verified)."""
        return len(self._blocks)

    def path(self, block_hash: bytes) -> Path:
        """Where the block file for `block_hash` lives (whether or not it exists)."""
        return self._blocks.path(block_hash)

    # --- reads and writes -------------------------------------------------

    def get(self, block_hash: bytes) -> DecodedBlock | None:
        """Read and verify a block; None when absent, unreadable or corrupt (a corrupt file is deleted)."""
        return self._read(self._blocks, block_hash, "KV block",
                          lambda data: decode(data, self.layout, block_hash))

    def put(self, block_hash: bytes, parent_hash: bytes, token_ids: tuple[int, ...], k, v) -> bool:
        """Store a block (evicting LRU files to stay in budget); False when it was not stored."""
        if not self.enabled:
            return False
        return self._store(self._blocks, block_hash, self.get,
                           lambda: encode(self.layout, block_hash, parent_hash, token_ids, k, v))

    # --- state snapshots (hybrid models) ------------------------------------

    def get_state(self, block_hash: bytes) -> torch.Tensor | None:
        """Read and verify a state snapshot (uint8); None when absent, unreadable or corrupt (a corrupt file is
        deleted: the state is recomputed)."""
        return self._read(self.states, block_hash, "state snapshot",
                          lambda data: decode_state(data, self.layout, block_hash))

    def put_state(self, block_hash: bytes, data: torch.Tensor) -> bool:
        """Store a state snapshot (evicting LRU files to stay in budget); False when it was not stored."""
        if not self.enabled or not self.layout.state_format:
            return False
        return self._store(self.states, block_hash, self.get_state,
                           lambda: encode_state(self.layout, block_hash, data))

    # --- one record, either kind ----------------------------------------------

    def _read(self, records: Records, block_hash: bytes, what: str, decoder):
        """Read a file of `records` and decode it with `decoder`; None when absent, unreadable or corrupt (deleted)."""
        path = records.own.get(block_hash)
        if path is None:
            return None
        try:
            with open(path, "rb", buffering=0) as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                n = f.readinto(data)
            if n != len(data):
                raise CorruptBlockError("short read")
            found = decoder(data)
        except CorruptBlockError as e:
            self.num_corrupt += 1
            log.warning("ignoring corrupt %s file %s (%s); it will be recomputed", what, path, e)
            self._forget(path, delete=True)
            return None
        except OSError as e:
            log.warning("cannot read %s file %s (%s); it will be recomputed", what, path, e)
            self._forget(path, delete=not isinstance(e, FileNotFoundError))
            return None
        records.verified.add(block_hash)
        self._files.move_to_end(path)
        try:
            os.utime(path)  # LRU order survives a restart
        except OSError:
            pass
        return found

    def _store(self, records: Records, block_hash: bytes, read, pieces_of) -> bool:
        """Store the record `pieces_of()` makes for `block_hash` in `records` (atomic, within budget); True at once
        when a whole copy is there already (known, or checked with `read`: a damaged one is deleted and replaced);
        False when it was not stored."""
        path = records.own.get(block_hash)
        if path is not None and (block_hash in records.verified or read(block_hash) is not None):
            self._files.move_to_end(path)
            return True
        path = records.path(block_hash)
        if path in self._skipped:
            return False
        pieces = pieces_of()
        size = file_size(pieces)
        if size > self.capacity_bytes:
            return False
        try:
            self._evict_to(self.capacity_bytes - size)
            self._write_atomic(path, pieces)
        except OSError as e:
            if _is_irregular(path):  # something else took the record's name: skip this one, keep the tier
                self._skip(path)
            else:
                self._disable(e)
            return False
        self._files[path] = size
        records.own[block_hash] = path
        records.verified.add(block_hash)
        self.used_bytes += size
        return True

    # --- internals -------------------------------------------------------

    def _write_atomic(self, path: Path, pieces) -> None:
        """Write `pieces` to a temp file in the same folder, then rename it to `path`."""
        tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            with open(tmp, "wb") as f:
                for p in pieces:
                    f.write(p)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise

    def _scan(self) -> None:
        """Index every block file under root (oldest first); delete stale temp files."""
        found: list[tuple[float, Path, int]] = []
        now = time.time()
        damaged = 0
        for sub in self.root.iterdir():
            if not (sub.is_dir() and not sub.is_symlink() and _LAYOUT_DIR.match(sub.name)):
                continue
            for entry in os.scandir(sub):
                try:
                    if not entry.is_file(follow_symlinks=False):
                        if _BLOCK_NAME.match(entry.name):
                            self._skip(Path(entry.path))
                        continue
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if entry.name.startswith(TMP_PREFIX):
                    if now - st.st_mtime > STALE_TMP_SECONDS:
                        self._unlink(Path(entry.path))
                elif _BLOCK_NAME.match(entry.name):
                    if sub == self.dir and not self._prefix_ok(Path(entry.path), st.st_size):
                        damaged += 1
                        self._unlink(Path(entry.path))
                        continue
                    found.append((st.st_mtime, Path(entry.path), st.st_size))
        if damaged:
            self.num_corrupt += damaged
            log.warning("deleted %d damaged KV block file(s) under %s; they will be recomputed and written again",
                        damaged, self.dir)
        found.sort(key=lambda x: x[0])
        for _, path, size in found:
            self._files[path] = size
            self.used_bytes += size
            if path.parent == self.dir:
                self._own_of(path)[bytes.fromhex(path.name[:-len(SUFFIX)])] = path

    def _prefix_ok(self, path: Path, size: int) -> bool:
        """Whether a block file's prefix and size fit the layout (a cheap start-up check; the checksum is read later)."""
        try:
            with open(path, "rb", buffering=0) as f:
                check_prefix(f.read(PREFIX_SIZE), size, self.layout, state=path.suffix == STATE_SUFFIX)
        except CorruptBlockError:
            return False
        except OSError:
            return True  # unreadable now: get() decides later
        return True

    def _skip(self, path: Path) -> None:
        """Never read or replace `path` (not a regular file); warn once per tier."""
        self._skipped.add(path)
        if not self._warned_skipped:
            self._warned_skipped = True
            log.warning("skipping %s and any other KV block name under %s that is not a regular file", path,
                        self.root)

    def _evict_to(self, limit: int) -> None:
        """Delete least recently used files until at most `limit` bytes remain."""
        while self.used_bytes > limit and self._files:
            path = next(iter(self._files))
            self._forget(path, delete=True)

    def _forget(self, path: Path, delete: bool) -> None:
        size = self._files.pop(path, None)
        if size is not None:
            self.used_bytes -= size
        if path.parent == self.dir:
            self._own_of(path).pop(bytes.fromhex(path.name[:-len(SUFFIX)]), None)
        if delete:
            self._unlink(path)

    def _own_of(self, path: Path) -> dict[bytes, Path]:
        """The index a file of this layout belongs in: state snapshots or blocks."""
        return (self.states if path.suffix == STATE_SUFFIX else self._blocks).own

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            path.unlink()
        except OSError:
            pass

    def _disable(self, error: OSError) -> None:
        if self.enabled:
            self.enabled = False
            log.warning("disk KV tier at %s turned off (%s); continuing without it", self.root, error)


def _is_irregular(path: Path) -> bool:
    """Whether something other than a regular file is at `path` (a folder, a symlink, a FIFO)."""
    try:
        return not stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False
