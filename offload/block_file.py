"""The on-disk format of one KV block (and of one recurrent-state snapshot): a fixed prefix, a JSON header, the
payload; checksummed.

    prefix  = magic (8 bytes) | header length (u32) | payload length (u64) | CRC-32 of header + payload (u32)
    header  = JSON {"layout": layout key, "hash": hex, "parent": hex, "tokens": [...]}
    payload = K then V, raw bytes in the layout's dtype and shape

A hybrid model's state snapshot (the recurrent state after the block `hash`) is a record of its own with magic
EDGEST01, header {"layout": layout key, "hash": hex, "state": the layout's state format} and as payload the
snapshot's bytes (layout.state_nbytes, the state tensors one after another in the spec's order).

The checksum guards against bit rot, torn writes and stray files, not against an adversary: CRC-32 detects
every burst error up to 32 bits and misses random damage with probability 2^-32, and it runs at several GB/s
where blake2b managed 0.3 GB/s on this machine (a disk hit must beat recomputing the prefix). Foreign and
misnamed files are caught by the header (layout key, block hash) and the exact size on top of that.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass

import torch

from .layout import KVLayout

MAGIC = b"EDGEKV01"
STATE_MAGIC = b"EDGEST01"
_PREFIX = struct.Struct("<8sIQI")
PREFIX_SIZE = _PREFIX.size
_MAX_HEADER = 1 << 20


class CorruptBlockError(ValueError):
    """A block file that must not be used: truncated, bit-flipped, foreign or for another key."""


@dataclass
class DecodedBlock:
    """A verified block read back from disk."""

    block_hash: bytes
    parent_hash: bytes
    token_ids: tuple[int, ...]
    k: torch.Tensor
    v: torch.Tensor


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of `t` without a copy when it is already contiguous on the CPU."""
    return memoryview(t.detach().contiguous().cpu().view(torch.uint8).reshape(-1).numpy())


def encode(layout: KVLayout, block_hash: bytes, parent_hash: bytes, token_ids: tuple[int, ...],
           k: torch.Tensor, v: torch.Tensor) -> list[memoryview | bytes]:
    """The pieces of a block file, in order (write them one after another)."""
    if tuple(k.shape) != layout.shape or tuple(v.shape) != layout.shape or k.dtype != layout.dtype \
            or v.dtype != layout.dtype:
        raise ValueError(f"block of shape {tuple(k.shape)} {k.dtype} does not match layout {layout.shape} {layout.dtype}")
    header = json.dumps({"layout": layout.key, "hash": block_hash.hex(), "parent": parent_hash.hex(),
                         "tokens": list(token_ids)}, separators=(",", ":")).encode()
    kb, vb = _raw(k), _raw(v)
    crc = zlib.crc32(vb, zlib.crc32(kb, zlib.crc32(header)))
    prefix = _PREFIX.pack(MAGIC, len(header), len(kb) + len(vb), crc)
    return [prefix, header, kb, vb]


def file_size(pieces: list[memoryview | bytes]) -> int:
    """Total bytes of an encoded block."""
    return sum(len(p) for p in pieces)


def check_prefix(prefix: bytes, file_size: int, layout: KVLayout, state: bool = False) -> tuple[int, int, int]:
    """Check a block file's (`state`: a state snapshot file's) fixed prefix against the layout and the file's size
    (no payload read): the cheap check a restart runs on every file. Returns (header length, payload length, CRC);
    CorruptBlockError if bad."""
    if len(prefix) < PREFIX_SIZE:
        raise CorruptBlockError("truncated prefix")
    magic, header_len, payload_len, crc = _PREFIX.unpack_from(prefix, 0)
    if magic != (STATE_MAGIC if state else MAGIC):
        raise CorruptBlockError("bad magic")
    if header_len > _MAX_HEADER or payload_len != (layout.state_nbytes if state else layout.block_nbytes):
        raise CorruptBlockError("header or payload length does not match the layout")
    if file_size != PREFIX_SIZE + header_len + payload_len:
        raise CorruptBlockError(f"size {file_size} != {PREFIX_SIZE + header_len + payload_len} (truncated?)")
    return header_len, payload_len, crc


def decode(data: bytearray, layout: KVLayout, expected_hash: bytes) -> DecodedBlock:
    """Verify a whole block file's bytes and return its block; CorruptBlockError says what is wrong."""
    header_len, payload_len, crc = check_prefix(bytes(data[:PREFIX_SIZE]), len(data), layout)
    body = memoryview(data)[PREFIX_SIZE:]
    if zlib.crc32(body) != crc:
        raise CorruptBlockError("checksum mismatch")
    try:
        header = json.loads(bytes(body[:header_len]))
        block_hash, parent = bytes.fromhex(header["hash"]), bytes.fromhex(header["parent"])
        tokens = tuple(int(t) for t in header["tokens"])
        layout_key = header["layout"]
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptBlockError(f"unreadable header: {e}") from None
    if layout_key != layout.key:
        raise CorruptBlockError("block belongs to another model or KV layout")
    if block_hash != expected_hash:
        raise CorruptBlockError("block hash does not match its file name")
    n = layout.tensor_nbytes
    payload = torch.frombuffer(data, dtype=torch.uint8, offset=PREFIX_SIZE + header_len, count=payload_len)
    k = payload[:n].view(layout.dtype).view(layout.shape)
    v = payload[n:].view(layout.dtype).view(layout.shape)
    return DecodedBlock(block_hash, parent, tokens, k, v)


def encode_state(layout: KVLayout, block_hash: bytes, data: torch.Tensor) -> list[memoryview | bytes]:
    """The pieces of a state snapshot file (`data`: the snapshot's bytes, uint8), in order."""
    if not layout.state_format or data.dtype != torch.uint8 or data.numel() != layout.state_nbytes:
        raise ValueError(f"state of {data.numel()} bytes does not match layout state {layout.state_nbytes}")
    header = json.dumps({"layout": layout.key, "hash": block_hash.hex(), "state": layout.state_format},
                        separators=(",", ":")).encode()
    body = _raw(data)
    crc = zlib.crc32(body, zlib.crc32(header))
    return [_PREFIX.pack(STATE_MAGIC, len(header), len(body), crc), header, body]


def decode_state(data: bytearray, layout: KVLayout, expected_hash: bytes) -> torch.Tensor:
    """Verify a whole state snapshot file's bytes and return the snapshot (uint8); CorruptBlockError if bad."""
    header_len, payload_len, crc = check_prefix(bytes(data[:PREFIX_SIZE]), len(data), layout, state=True)
    body = memoryview(data)[PREFIX_SIZE:]
    if zlib.crc32(body) != crc:
        raise CorruptBlockError("checksum mismatch")
    try:
        header = json.loads(bytes(body[:header_len]))
        block_hash, layout_key, state_format = bytes.fromhex(header["hash"]), header["layout"], header["state"]
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptBlockError(f"unreadable header: {e}") from None
    if layout_key != layout.key or state_format != layout.state_format:
        raise CorruptBlockError("state belongs to another model or state format")
    if block_hash != expected_hash:
        raise CorruptBlockError("state hash does not match its file name")
    return torch.frombuffer(data, dtype=torch.uint8, offset=PREFIX_SIZE + header_len, count=payload_len)
