"""Dequantize GGUF tensor data to float32 torch tensors, and expose 4-bit types as packed groups.

Block layouts follow ggml (ggml-common.h); results match `gguf.quants.dequantize` bit for bit.
"""

from __future__ import annotations

from math import prod
from typing import Callable

import numpy as np
import torch

from edgeserve.errors import ModelLoadError, UnsupportedModelError

# qtype -> (elements per block, bytes per block)
BLOCK_LAYOUTS: dict[str, tuple[int, int]] = {
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q8_0": (32, 2 + 32),
    "Q4_0": (32, 2 + 16),
    "Q4_1": (32, 2 + 2 + 16),
    "Q5_0": (32, 2 + 4 + 16),
    "Q5_1": (32, 2 + 2 + 4 + 16),
    "IQ4_NL": (32, 2 + 16),
    "Q2_K": (256, 16 + 64 + 2 + 2),
    "Q3_K": (256, 32 + 64 + 12 + 2),
    "Q4_K": (256, 2 + 2 + 12 + 128),
    "Q5_K": (256, 2 + 2 + 12 + 32 + 128),
    "Q6_K": (256, 128 + 64 + 16 + 2),
    "IQ4_XS": (256, 2 + 2 + 4 + 128),
    "MXFP4": (32, 1 + 16),
}

SUPPORTED_QTYPES = frozenset(BLOCK_LAYOUTS)
Q4_QTYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})
GROUP_SIZE = 32

# Decode slices of about this many weights at a time: bounds the temporaries for big tensors
# (embeddings) to a few MB without paying per-call overhead on small ones.
_CHUNK_ELEMENTS = 1 << 20


def dequantize(raw: np.ndarray, qtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Stored GGUF data of type `qtype` -> new float32 tensor of `shape` (torch order).

    `raw` is a GGUF reader tensor's `.data` (bytes for block types, typed values for F32/F16);
    it is only read, so a read-only mmap view is fine.
    """
    decode = _DECODERS.get(qtype)
    if decode is None:
        raise UnsupportedModelError(
            f"quantization type {qtype} is not supported (supported: {', '.join(sorted(SUPPORTED_QTYPES))})"
        )
    block, size = BLOCK_LAYOUTS[qtype]
    blocks = _blocks(raw, qtype, shape)
    n_blocks = blocks.shape[0]
    out = torch.empty((n_blocks, block), dtype=torch.float32)
    step = max(1, _CHUNK_ELEMENTS // block)
    buf = torch.empty((min(step, n_blocks), size), dtype=torch.uint8)
    buf_np = buf.numpy()
    for start in range(0, n_blocks, step):
        stop = min(start + step, n_blocks)
        # Copying into our own buffer keeps torch off the read-only mmap (no writes, no warning).
        buf_np[: stop - start] = blocks[start:stop]
        decode(buf[: stop - start], out[start:stop])
    return out.view(shape)


def q4_blocks(raw: np.ndarray, qtype: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0, Q4_1 or Q4_K tensor as 4-bit codes with a scale and offset per group of 32 weights.

    With `rows = prod(shape[:-1])` and `cols = shape[-1]`, returns
      q:      uint8   [rows, cols]       codes 0..15, in weight order
      scale:  float32 [rows, cols // 32]
      offset: float32 [rows, cols // 32]
    such that weight[r, c] = q[r, c] * scale[r, c // 32] + offset[r, c // 32], which equals
    `dequantize(raw, qtype, shape)` exactly. Per type: Q4_0 scale = d, offset = -8*d;
    Q4_1 scale = d, offset = m; Q4_K scale = d*sc, offset = -dmin*m for each 32-weight sub-block.
    """
    if qtype not in Q4_QTYPES:
        raise UnsupportedModelError(f"q4_blocks handles {', '.join(sorted(Q4_QTYPES))}, not {qtype}")
    blocks = torch.from_numpy(np.array(_blocks(raw, qtype, shape)))
    rows = prod(shape[:-1])
    cols = shape[-1]
    if qtype == "Q4_K":
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc, mn = _k_scale_min(blocks[:, 4:16])
        q = _k_nibbles(blocks[:, 16:])
        scale = d * sc.float()
        offset = -(dmin * mn.float())
    else:
        d = _f16(blocks[:, 0:2])
        if qtype == "Q4_0":
            q = _nibbles32(blocks[:, 2:])
            scale, offset = d, d * -8.0
        else:
            q = _nibbles32(blocks[:, 4:])
            scale, offset = d, _f16(blocks[:, 2:4])
    return q.reshape(rows, cols), scale.reshape(rows, cols // GROUP_SIZE), offset.reshape(rows, cols // GROUP_SIZE)


def q8_blocks(raw: np.ndarray, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor as int8 codes q [rows, cols] and a float32 scale [rows, cols // 32] (weight = q * scale),
    which equals `dequantize(raw, "Q8_0", shape)` exactly."""
    blocks = torch.from_numpy(np.array(_blocks(raw, "Q8_0", shape)))
    rows, cols = prod(shape[:-1]), shape[-1]
    q = blocks[:, 2:].contiguous().view(torch.int8)
    return q.reshape(rows, cols), _f16(blocks[:, 0:2]).reshape(rows, cols // GROUP_SIZE)


def _blocks(raw: np.ndarray, qtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """`raw` as a (n_blocks, bytes_per_block) uint8 array, after checking its size against `shape`."""
    block, size = BLOCK_LAYOUTS[qtype]
    arr = np.asarray(raw)
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    data = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    n = prod(shape)
    if n % block or data.size != n // block * size:
        raise ModelLoadError(
            f"{qtype} tensor of shape {tuple(shape)} should have {n // block * size} bytes "
            f"(in blocks of {block}), got {data.size}"
        )
    return data.reshape(-1, size)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(k, 2) little-endian fp16 bytes -> (k, 1) float32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """(k, 16) packed bytes -> (k, 32) codes: low nibbles are weights 0..15, high nibbles 16..31."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(k, 128) Q4_K/Q5_K packed bytes -> (k, 256) codes; each 32 bytes hold 64 weights, low nibbles first."""
    qs = qs.reshape(-1, 4, 1, 32)
    return torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(-1, 256)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, 12) packed 6-bit sub-block scales and mins of Q4_K/Q5_K -> two (k, 8) uint8."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)), dim=1)
    mn = torch.cat((mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)), dim=1)
    return sc, mn


# Decoders fill `out` (k, block) float32 from `b` (k, bytes_per_block) uint8. The arithmetic
# order mirrors ggml's reference code so the float32 results are identical, not just close.


def _decode_f32(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(b.view(torch.float32))


def _decode_f16(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(b.view(torch.float16))


def _decode_bf16(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(b.view(torch.bfloat16))


def _decode_q8_0(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(b[:, 2:].view(torch.int8))
    out.mul_(_f16(b[:, 0:2]))


def _decode_q4_0(b: torch.Tensor, out: torch.Tensor) -> None:
    qs = b[:, 2:]
    out[:, :16] = qs & 0x0F
    out[:, 16:] = qs >> 4
    out.sub_(8.0).mul_(_f16(b[:, 0:2]))


def _decode_q4_1(b: torch.Tensor, out: torch.Tensor) -> None:
    qs = b[:, 4:]
    out[:, :16] = qs & 0x0F
    out[:, 16:] = qs >> 4
    out.mul_(_f16(b[:, 0:2])).add_(_f16(b[:, 2:4]))


def _apply_k_scale_min(b: torch.Tensor, out: torch.Tensor) -> None:
    """out (holding codes) -> (d*sc) * q - dmin*m per 32-weight sub-block (Q4_K, Q5_K)."""
    sc, mn = _k_scale_min(b[:, 4:16])
    scale = _f16(b[:, 0:2]) * sc.float()
    dm = _f16(b[:, 2:4]) * mn.float()
    out8 = out.view(-1, 8, 32)
    out8.mul_(scale.unsqueeze(-1)).sub_(dm.unsqueeze(-1))


def _decode_q4_k(b: torch.Tensor, out: torch.Tensor) -> None:
    qs = b[:, 16:].reshape(-1, 4, 1, 32)
    out4 = out.view(-1, 4, 2, 32)
    out4[:, :, 0:1] = qs & 0x0F
    out4[:, :, 1:2] = qs >> 4
    _apply_k_scale_min(b, out)


_QH_SHIFTS_5 = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
_QH_SHIFTS_6 = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)


def _decode_q5_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # bit i of qh[j] is the fifth bit of weight j in sub-block i
    high = ((b[:, 16:48].unsqueeze(1) >> _QH_SHIFTS_5) & 1) << 4
    out.copy_(_k_nibbles(b[:, 48:]) | high.reshape(-1, 256))
    _apply_k_scale_min(b, out)


def _decode_q6_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # two halves of 128 weights: 64 ql bytes (low nibbles, then high nibbles) and 32 qh bytes (2 bits x 4)
    ql = b[:, 0:128].reshape(-1, 2, 1, 64)
    low = torch.cat((ql & 0x0F, ql >> 4), dim=2).reshape(-1, 256)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)
    high = ((qh >> _QH_SHIFTS_6) & 3).reshape(-1, 256)
    out.copy_((low | (high << 4)).view(torch.int8) - 32)
    scale = _f16(b[:, 208:210]) * b[:, 192:208].view(torch.int8).float()
    out.view(-1, 16, 16).mul_(scale.unsqueeze(-1))


# byte value -> its 8 bits (least significant first) times 16, as float32: one gather per qh byte
_FIFTH_BITS = ((torch.arange(256).view(256, 1) >> torch.arange(8).view(1, 8)) & 1).float() * 16


def _q5_codes(b: torch.Tensor, qh_at: int, out: torch.Tensor) -> None:
    """Fill out (k, 32) with Q5_0/Q5_1's 5-bit codes: nibbles as Q4_0, and bit j of the little-endian uint32 qh
    (byte j // 8, bit j % 8) is weight j's fifth bit."""
    qs = b[:, qh_at + 4 :]
    out[:, :16] = qs & 0x0F
    out[:, 16:] = qs >> 4
    out.add_(_FIFTH_BITS[b[:, qh_at : qh_at + 4].long()].view(-1, 32))


def _decode_q5_0(b: torch.Tensor, out: torch.Tensor) -> None:
    _q5_codes(b, 2, out)
    out.sub_(16.0).mul_(_f16(b[:, 0:2]))


def _decode_q5_1(b: torch.Tensor, out: torch.Tensor) -> None:
    _q5_codes(b, 4, out)
    out.mul_(_f16(b[:, 0:2])).add_(_f16(b[:, 2:4]))


# IQ4_NL / IQ4_XS: a 4-bit code indexes this non-linear table of int8 levels (ggml's kvalues_iq4nl).
_IQ4_LEVELS = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                           dtype=torch.float32)


def _decode_iq4_nl(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_IQ4_LEVELS[_nibbles32(b[:, 2:]).long()])
    out.mul_(_f16(b[:, 0:2]))


# MXFP4 (OCP microscaling): a 4-bit E2M1 code indexes these doubled values, and the block's E8M0 exponent byte e
# gives the halved scale 2^(e - 128) (ggml's kvalues_mxfp4 and ggml_e8m0_to_fp32_half).
_MXFP4_LEVELS = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """(k, 1) E8M0 exponent bytes -> (k, 1) float32 2^(e - 128): subnormal for e < 2, at most 2^127 (no NaN)."""
    e32 = e.to(torch.int32)
    bits = torch.where(e32 < 2, 0x00200000 << e32.clamp(max=1), (e32 - 1) << 23)
    return bits.view(torch.float32)


def _decode_mxfp4(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_MXFP4_LEVELS[_nibbles32(b[:, 1:]).long()])
    out.mul_(_e8m0_half(b[:, 0:1]))


_SHIFTS_2BIT = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)


def _decode_q2_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # 16 sub-blocks of 16: scale (low nibble) and min (high nibble) per sub-block; 2-bit codes, 4 per byte
    scales = b[:, 0:16]
    dl = (_f16(b[:, 80:82]) * (scales & 0x0F).float()).unsqueeze(-1)
    ml = (_f16(b[:, 82:84]) * (scales >> 4).float()).unsqueeze(-1)
    q = (b[:, 16:80].reshape(-1, 2, 1, 32) >> _SHIFTS_2BIT) & 3
    out.copy_(q.reshape(-1, 256))
    out.view(-1, 16, 16).mul_(dl).sub_(ml)


_SHIFTS_4 = torch.tensor([0, 4], dtype=torch.uint8).view(1, 2, 1)
_SHIFTS_SCALE_HI = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 4, 1)
_SHIFTS_8 = torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1)


def _decode_q3_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # hmask (32) | 2-bit codes (64) | 16 packed 6-bit signed scales (12) | d; a clear hmask bit subtracts 4
    sc = b[:, 96:108]
    low = ((sc[:, 0:8].reshape(-1, 1, 8) >> _SHIFTS_4) & 0x0F).reshape(-1, 16)
    high = ((sc[:, 8:12].reshape(-1, 1, 4) >> _SHIFTS_SCALE_HI) & 3).reshape(-1, 16)
    scales = ((low | (high << 4)).view(torch.int8) - 32).float()
    dl = (_f16(b[:, 108:110]) * scales).unsqueeze(-1)
    ql = ((b[:, 32:96].reshape(-1, 2, 1, 32) >> _SHIFTS_2BIT) & 3).reshape(-1, 256)
    qh = ((b[:, 0:32].reshape(-1, 1, 1, 32) >> _SHIFTS_8) & 1).reshape(-1, 256) ^ 1
    out.copy_(ql.to(torch.int8) - (qh << 2).to(torch.int8))
    out.view(-1, 16, 16).mul_(dl)


_SHIFTS_SCALE_XS = (2 * torch.arange(8, dtype=torch.int32)).view(1, 8)


def _decode_iq4_xs(b: torch.Tensor, out: torch.Tensor) -> None:
    # d | scales_h (uint16, 2 bits per sub-block) | scales_l (4 bits per sub-block) | 8 sub-blocks of 16 bytes
    scales_h = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    high = ((scales_h >> _SHIFTS_SCALE_XS) & 3).to(torch.uint8)
    low = ((b[:, 4:8].reshape(-1, 4, 1) >> _SHIFTS_4.view(1, 1, 2)) & 0x0F).reshape(-1, 8)
    scales = ((low | (high << 4)).view(torch.int8) - 32).float()
    dl = (_f16(b[:, 0:2]) * scales).unsqueeze(-1)
    qs = b[:, 8:136].reshape(-1, 8, 1, 16)
    codes = torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(-1, 256)
    out.copy_(_IQ4_LEVELS[codes.long()])
    out.view(-1, 8, 32).mul_(dl)


_DECODERS: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
    "F32": _decode_f32,
    "F16": _decode_f16,
    "BF16": _decode_bf16,
    "Q8_0": _decode_q8_0,
    "Q4_0": _decode_q4_0,
    "Q4_1": _decode_q4_1,
    "Q5_0": _decode_q5_0,
    "Q5_1": _decode_q5_1,
    "IQ4_NL": _decode_iq4_nl,
    "MXFP4": _decode_mxfp4,
    "Q2_K": _decode_q2_k,
    "Q3_K": _decode_q3_k,
    "IQ4_XS": _decode_iq4_xs,
    "Q4_K": _decode_q4_k,
    "Q5_K": _decode_q5_k,
    "Q6_K": _decode_q6_k,
}
