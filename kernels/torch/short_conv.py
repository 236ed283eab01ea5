"""Causal depthwise convolution over a flat ragged batch with per-sequence conv states (torch twins, float32), and
the gated short convolution built on it (LFM2's mixer between its projections).

The batch and states follow kernels.torch.gated_delta: sequence i owns rows cu_seqlens[i]:cu_seqlens[i + 1] of the step
(a `DeltaBatch`) and reads and writes its conv state [K - 1, C] (the last K - 1 inputs, oldest first; zeros for a
fresh sequence) at `slots[i]` of a pool [num_slots, K - 1, C]. This module knows no model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # kernels.torch.gated_delta imports this module
    from edgeserve.kernels.torch.gated_delta import DeltaBatch


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, batch: "DeltaBatch",
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """The causal depthwise convolution of x [T, C] with weight [C, K] (and `bias` [C]), each sequence continuing
    from the K - 1 inputs in its conv state; writes each sequence's last K - 1 inputs back. Returns float32 [T, C]."""
    t, c = x.shape
    k = weight.shape[1]
    batch.check_fits(t, conv_state.shape[0])
    if weight.shape[0] != c or tuple(conv_state.shape[1:]) != (k - 1, c):
        raise ValueError(f"conv weight {tuple(weight.shape)} / state {tuple(conv_state.shape)} do not fit x "
                         f"[{t}, {c}]")
    if batch.max_len == 1 and t == batch.lens.numel():
        y = _one_token_each(x, weight, conv_state, batch.slots.long())
    else:
        y = _ragged(x, weight, conv_state, batch)
    return y if bias is None else y + bias.float()


def _ragged(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, batch: "DeltaBatch") -> torch.Tensor:
    """causal_conv1d over any ragged batch: each sequence's rows padded to the longest."""
    c, k = x.shape[1], weight.shape[1]
    seq, pos, lens, length, slots = batch.seq, batch.pos, batch.lens, batch.max_len, batch.slots.long()
    # each sequence's window: its K - 1 stored inputs, then its new ones
    rows = x.new_zeros(lens.numel(), length, c, dtype=torch.float32)
    rows[seq, pos] = x.float()
    window = torch.cat([conv_state[slots].float(), rows], dim=1)
    w = weight.float()
    out = sum(window[:, j:j + length] * w[:, j] for j in range(k))  # [B, L, C]
    if k > 1:  # the last K - 1 inputs sit at window rows len .. len + K - 2
        last = lens[:, None] + torch.arange(k - 1, device=lens.device)
        conv_state[slots] = torch.gather(window, 1, last[:, :, None].expand(-1, -1, c)).to(conv_state.dtype)
    return out[seq, pos]


def _one_token_each(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                    slots: torch.Tensor) -> torch.Tensor:
    """causal_conv1d of a decode step (sequence i owns row i alone): the same products summed in the same order as
    `_ragged`, without the padding."""
    k = weight.shape[1]
    window = torch.cat([conv_state[slots].float(), x.float()[:, None]], dim=1)  # [B, K, C]
    w = weight.float()
    out = sum(window[:, j] * w[:, j] for j in range(k))
    if k > 1:
        conv_state[slots] = window[:, 1:].to(conv_state.dtype)
    return out


def gated_short_conv(bcx: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, batch: "DeltaBatch",
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """A gated short convolution: bcx [T, 3C] is [b | c | x] per row; returns float32 c * conv(b * x) [T, C], the
    conv over b * x continuing from (and updating) each sequence's conv state."""
    if bcx.shape[-1] % 3:
        raise ValueError(f"a gated short convolution takes [b | c | x] rows, not width {bcx.shape[-1]}")
    b, c, x = bcx.float().chunk(3, dim=-1)
    return c * causal_conv1d(b * x, weight, conv_state, batch, bias)
