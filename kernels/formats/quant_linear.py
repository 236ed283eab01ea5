"""Linear layers over weights that stay quantized: 4-bit packed (W4A16) with group-wise scale and offset, and
int8 per row; the group-wise int4 quantizer (`Q4Blocks.quantize`) and GGUF Q8_0's 8-bit blocks (`Q8Blocks`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from edgeserve.kernels.formats.grouped import GroupBlocks
from edgeserve.kernels.transfer import to_device


@dataclass
class Q4Blocks(GroupBlocks):
    """A 4-bit weight as values q in 0..15 with w = q * scale + offset per group of `group_size` columns."""

    q: torch.Tensor  # uint8 [out, in]
    scale: torch.Tensor  # float32 [out, in // group_size]
    offset: torch.Tensor  # float32 [out, in // group_size]
    group_size: int = 32

    def dequantize(self) -> torch.Tensor:
        """The float32 weight these blocks stand for."""
        g = self.group_size
        q = self.q.float().view(self.q.shape[0], -1, g)
        return (q * self.scale.unsqueeze(-1) + self.offset.unsqueeze(-1)).reshape(self.q.shape)

    @staticmethod
    def quantize(w: torch.Tensor, group_size: int = 128) -> "Q4Blocks":
        """Group-wise asymmetric round-to-nearest 4-bit quantization of a float weight [out, in].

        Each group of `group_size` consecutive input columns of a row gets offset = its minimum and
        scale = (max - min) / 15, and q = round((w - min) / scale) in 0..15, so a group's extremes are exact
        and every weight is within scale / 2 of its original value.
        """
        out_f, in_f = w.shape
        if in_f % group_size:
            raise ValueError(f"in_features {in_f} is not a multiple of the group size {group_size}")
        g = w.float().reshape(out_f, in_f // group_size, group_size)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp_min(1e-10)
        q = torch.round((g - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp_(0, 15).to(torch.uint8)
        return Q4Blocks(q.reshape(out_f, in_f), scale, lo, group_size)

    def regroup(self, group_size: int) -> "Q4Blocks":
        """The same weight with smaller groups (`group_size` dividing the current one): exact, scales repeat."""
        if self.group_size % group_size:
            raise ValueError(f"group size {group_size} does not divide {self.group_size}")
        r = self.group_size // group_size
        return Q4Blocks(self.q, self.scale.repeat_interleave(r, dim=1), self.offset.repeat_interleave(r, dim=1),
                        group_size)

    @classmethod
    def cat(cls, parts: list["Q4Blocks"]) -> "Q4Blocks":  # type: ignore[override]
        """Stack weights along the output dimension (for fused QKV and gate/up); group sizes may differ."""
        g = min(p.group_size for p in parts)
        return Q4Blocks.stack([p.regroup(g) if p.group_size != g else p for p in parts])


@dataclass
class Q8Blocks(GroupBlocks):
    """An 8-bit weight (GGUF Q8_0) as int8 values with w = q * scale per group of `group_size` columns."""

    q: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # float32 [out, in // group_size]
    group_size: int = 32

    def dequantize(self) -> torch.Tensor:
        """The float32 weight these blocks stand for."""
        q = self.q.float().view(self.q.shape[0], -1, self.group_size)
        return (q * self.scale.unsqueeze(-1)).reshape(self.q.shape)


# group sizes torch's CPU int4 matmul takes; other multiples of 32 are regrouped (exactly) to the largest of these
CPU_INT4_GROUP_SIZES = (256, 128, 64, 32)


def cpu_int4_group_size(blocks: Q4Blocks) -> int | None:
    """The group size the CPU int4 op runs this weight with (its own, or a divisor of it), or None."""
    in_f = blocks.shape[1]
    for g in CPU_INT4_GROUP_SIZES:
        if blocks.group_size % g == 0 and in_f % g == 0:
            return g
    return None


class Int4Weight:
    """A Q4Blocks weight packed for the CPU int4 matmul (`_weight_int4pack_mm_for_cpu`).

    torch's CPU int4 kernel works row by row (its cost grows linearly with the rows), which suits decode but
    makes a long prompt slow; with `keep_dense` the weight is also kept dequantized, and prompt rows go through
    the dense matmul (see `PromptRows`).
    """

    def __init__(self, blocks: Q4Blocks, dtype: torch.dtype, keep_dense: bool = False):
        g = cpu_int4_group_size(blocks)
        if g is None:
            raise ValueError(f"group size {blocks.group_size} does not fit torch's CPU int4 matmul")
        if g != blocks.group_size:  # e.g. per-channel (group = in_features) AWQ/GPTQ weights
            blocks = blocks.regroup(g)
        self.out_features, self.in_features = blocks.shape
        self.group_size = blocks.group_size
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.q.to(torch.int32).contiguous(), 1)
        # The op computes w = (q - 8) * scale + zero, so zero = offset + 8 * scale.
        zero = blocks.offset + 8 * blocks.scale
        self.scales_zeros = torch.stack([blocks.scale.t(), zero.t()], dim=-1).contiguous().to(dtype)
        self.dense = blocks.dequantize().to(dtype) if keep_dense else None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] @ W.T -> [..., out]."""
        # the model's 2-D case skips the reshapes and the no-op cast (decode runs this ~100 times a step)
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if x2.dtype != self.scales_zeros.dtype:
            x2 = x2.to(self.scales_zeros.dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_zeros)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)


class Int8Weight:
    """A weight quantized per output row to int8 for the CPU int8 matmul; also serves embedding lookups."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, chunk_rows: int = 4096):
        self.out_features, self.in_features = weight.shape
        self.q = torch.empty(weight.shape, dtype=torch.int8)
        scale = torch.empty(self.out_features)
        for start in range(0, self.out_features, chunk_rows):  # chunks keep the float temporaries small
            w = weight[start:start + chunk_rows].float()
            s = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
            self.q[start:start + chunk_rows] = torch.round(w / s[:, None]).to(torch.int8)
            scale[start:start + chunk_rows] = s
        self.scales = scale.to(dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] @ W.T -> [..., out]."""
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(self.scales.dtype), self.q, self.scales)
        return y.reshape(*shape[:-1], self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Float32 rows of W for the given ids (an embedding lookup)."""
        return self.q[ids].float() * self.scales[ids].float().unsqueeze(-1)


def int8_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this device has a fast int8 weight matmul for this activation dtype."""
    return device.type == "cpu" and dtype == torch.bfloat16 and hasattr(torch.ops.aten, "_weight_int8pack_mm")


def int4_supported(device: torch.device, dtype: torch.dtype, blocks: Q4Blocks) -> bool:
    """Whether this device has a fast packed int4 matmul for this weight and activation dtype."""
    # torch's CPU int4 kernel is fast only for bf16 activations; fp32/fp16 take a slow reference path.
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
        and cpu_int4_group_size(blocks) is not None
        and blocks.shape[0] % 16 == 0  # the op packs rows in sixteens
    )


LinearWeight = torch.Tensor | Int4Weight | Int8Weight

PROMPT_TILE = 64


@dataclass
class PromptRows:
    """Which rows of a step's flat batch are prompt tokens (computed through the dense copy of an Int4Weight).

    Prompt rows are multiplied in fixed tiles of PROMPT_TILE rows: a dense matmul's rounding depends on how many
    rows it is given, and fixed tiles keep each row's result independent of how the prompt was chunked or what
    else ran in the step. Generated tokens (decode, speculative verification, recomputed outputs) always take
    the packed int4 kernel, whose rows are independent too, so a token's KV does not depend on the batch.
    """

    dense: torch.Tensor  # [P] long: prompt rows
    packed: torch.Tensor  # [T - P] long: the other rows

    @classmethod
    def build(cls, is_prompt: list[bool], device: torch.device | str = "cpu") -> "PromptRows | None":
        """The split for one step's rows, or None when no row is a prompt row."""
        if not any(is_prompt):
            return None
        mask = torch.tensor(is_prompt, dtype=torch.bool)
        return cls(to_device(mask.nonzero().squeeze(1), torch.long, device),
                   to_device((~mask).nonzero().squeeze(1), torch.long, device))


def dense_tiles(x: torch.Tensor, w: torch.Tensor, tile: int = PROMPT_TILE) -> torch.Tensor:
    """x [P, in] @ w.T in tiles of exactly `tile` rows (the last one zero-padded): a row's result does not
    depend on how many rows came with it."""
    p = x.shape[0]
    if p == 0:
        return x.new_empty(0, w.shape[0])
    pad = -p % tile
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    if x.shape[0] == tile:
        return F.linear(x, w)[:p]
    out = torch.cat([F.linear(t, w) for t in x.split(tile)])
    return out[:p]


def _int4_prompt_linear(x: torch.Tensor, weight: Int4Weight, rows: PromptRows) -> torch.Tensor:
    dense = weight.dense
    x = x.to(dense.dtype)
    if rows.packed.numel() == 0:
        return dense_tiles(x, dense)
    y = x.new_empty(x.shape[0], weight.out_features)
    y[rows.dense] = dense_tiles(x[rows.dense], dense)
    y[rows.packed] = weight.matmul(x[rows.packed])
    return y


def linear(x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None,
           prompt_rows: PromptRows | None = None) -> torch.Tensor:
    """y = x @ W.T (+ b) for a dense or packed weight (anything with `matmul(x)`, e.g. Int4Weight, Int8Weight);
    `prompt_rows` routes prompt rows of an Int4Weight that keeps a dense copy through that copy."""
    if not isinstance(weight, torch.Tensor):
        if prompt_rows is not None and isinstance(weight, Int4Weight) and weight.dense is not None:
            y = _int4_prompt_linear(x, weight, prompt_rows)
        else:
            y = weight.matmul(x)
        return y + bias if bias is not None else y
    # x (and a bias) in the weight's dtype: a float32 attention output (beside an f16 KV pool) meets bf16 weights
    return F.linear(x.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype))
