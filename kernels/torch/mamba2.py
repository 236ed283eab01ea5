"""The Mamba-2 mixer over a flat ragged batch with per-sequence conv and SSM states (torch, float32): the causal
depthwise convolution over [x | B | C], the SSD recurrence (a chunked scan for prompts, one step per token for
decode), the gated group RMSNorm. This module knows no model.

The batch follows kernels.torch.gated_delta: sequence i owns rows cu_seqlens[i]:cu_seqlens[i + 1] of the step (a
`DeltaBatch`) and its states at `slots[i]`: conv [K - 1, conv_dim] (kernels.torch.short_conv) and ssm [H, P, N], the
recurrence's state per head (P = head_dim values x N = state size). Per head h and token t, with dt the softplus of
the projected dt plus its bias, A < 0 per head and B, C from head h's group:
    state <- exp(dt * A) * state + dt * x_t B_t^T,    y_t = state C_t + D * x_t.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from edgeserve.kernels.torch.short_conv import causal_conv1d

if TYPE_CHECKING:
    from edgeserve.kernels.torch.gated_delta import DeltaBatch

CHUNK = 64  # the chunked scan's chunk length (float32 sums over at most this many positions at once)


@dataclass(frozen=True)
class Mamba2Dims:
    """A Mamba-2 layer's shape: H heads of P values, N state size, G groups of B / C, conv kernel K."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int

    def __post_init__(self) -> None:
        if min(self.num_heads, self.head_dim, self.state_size, self.n_groups, self.conv_kernel) < 1 \
                or self.num_heads % self.n_groups:
            raise ValueError(f"Mamba-2 dims need positive sizes and heads a multiple of the groups: {self}")

    @property
    def inner(self) -> int:
        """H * P: the width of x, z and y."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """The conv's channels: x, B and C."""
        return self.inner + 2 * self.n_groups * self.state_size

    @property
    def in_proj_dim(self) -> int:
        """in_proj's output: [z | x B C | dt]."""
        return self.inner + self.conv_dim + self.num_heads


def _by_head(bc: torch.Tensor, heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N]: each head reads its group's row."""
    return bc.repeat_interleave(heads // bc.shape[-2], dim=-2)


def ssd_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: x [S, H, P], dt [S, H], B / C [S, G, N], state [S, H, P, N] (float32). Returns
    (y [S, H, P], the new state)."""
    h = x.shape[1]
    state = state * torch.exp(dt * A)[..., None, None] \
        + (dt[..., None] * x)[..., None] * _by_head(B, h)[:, :, None, :]
    y = (state @ _by_head(C, h)[..., None])[..., 0] + D[:, None] * x
    return y, state


def _chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             state: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over padded sequences x [S, L, H, P] (dt [S, L, H], B / C [S, L, H, N] by head, padding with
    dt 0) from `state` [S, H, P, N], chunk by chunk: within a chunk as a masked product (decay between positions),
    across chunks through the state. Returns (y without D [S, L, H, P], the final state)."""
    s, length = x.shape[:2]
    ys = []
    for start in range(0, length, chunk):
        xc, dtc = x[:, start:start + chunk], dt[:, start:start + chunk]
        bc, cc = B[:, start:start + chunk], C[:, start:start + chunk]
        a = torch.cumsum(dtc * A, dim=1)  # [S, l, H]: log decay from the chunk's start through position t
        # decay from position j (after its input) to position t: exp(a_t - a_j) for j <= t
        diff = a[:, :, None, :] - a[:, None, :, :]  # [S, t, j, H]
        causal = torch.ones(diff.shape[1], diff.shape[2], dtype=torch.bool, device=x.device).tril()
        decay = torch.where(causal[None, :, :, None], diff, torch.full_like(diff, -torch.inf)).exp()
        scores = torch.einsum("sthn,sjhn->stjh", cc, bc) * decay
        xdt = xc * dtc[..., None]
        y = torch.einsum("stjh,sjhp->sthp", scores, xdt)
        y = y + torch.einsum("sthn,shpn->sthp", cc, state) * a.exp()[..., None]
        ys.append(y)
        to_end = (a[:, -1:] - a).exp()  # [S, l, H]: decay from each position to the chunk's end
        state = state * a[:, -1].exp()[..., None, None] \
            + torch.einsum("sjhn,sjhp->shpn", bc * to_end[..., None], xdt)
    return torch.cat(ys, dim=1), state


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor, ssm_state: torch.Tensor, batch: "DeltaBatch", chunk: int = CHUNK) -> torch.Tensor:
    """The SSD recurrence over a ragged batch: x [T, H, P], dt [T, H] (after softplus), A [H] (negative), B / C
    [T, G, N], D [H]; each sequence continues from (and writes back) its state in ssm_state [slots, H, P, N].
    Returns float32 y [T, H, P]."""
    t, h, p = x.shape
    batch.check_fits(t, ssm_state.shape[0])
    slots = batch.slots.long()
    state = ssm_state[slots].float()
    x, dt, B, C = x.float(), dt.float(), B.float(), C.float()
    A, D = A.float(), D.float()
    if batch.max_len == 1 and t == batch.lens.numel():
        y, state = ssd_step(x, dt, A, B, C, D, state)
    else:
        n, length = batch.lens.numel(), batch.max_len
        seq, pos = batch.seq, batch.pos

        def padded(v: torch.Tensor) -> torch.Tensor:
            out = v.new_zeros(n, length, *v.shape[1:])
            out[seq, pos] = v
            return out

        yp, state = _chunked(padded(x), padded(dt), A, padded(_by_head(B, h)), padded(_by_head(C, h)), state,
                             chunk)
        y = yp[seq, pos] + D[:, None] * x
    ssm_state[slots] = state.to(ssm_state.dtype)
    return y


def gated_group_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int,
                         eps: float) -> torch.Tensor:
    """RMSNorm of y * silu(z) [T, W] over each of `groups` equal slices of the width, times weight [W]; float32."""
    g = (y.float() * F.silu(z.float())).unflatten(-1, (groups, -1))
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return g.flatten(-2) * weight.float().reshape(-1)


def mamba2_mixer(zxbcdt: torch.Tensor, dims: Mamba2Dims, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                 dt_bias: torch.Tensor, A: torch.Tensor, D: torch.Tensor, norm_weight: torch.Tensor | None,
                 eps: float, conv_state: torch.Tensor, ssm_state: torch.Tensor, batch: "DeltaBatch",
                 scan: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """A Mamba-2 mixer between its projections: zxbcdt [T, in_proj_dim] (in_proj's output) to the gated, normed
    y [T, H * P] (float32) that out_proj takes, continuing from and updating each sequence's conv and ssm states;
    without a norm weight (Falcon-H1's `mamba_rms_norm` off) y * silu(z) alone. `scan`: the recurrence (ssd_scan's
    signature; kernels.dispatch.ssd_scan picks the native one), ssd_scan by default."""
    d = dims
    z, xbc, dt = zxbcdt.float().split([d.inner, d.conv_dim, d.num_heads], dim=-1)
    xbc = F.silu(causal_conv1d(xbc, conv_weight, conv_state, batch, conv_bias))
    x, B, C = xbc.split([d.inner, d.n_groups * d.state_size, d.n_groups * d.state_size], dim=-1)
    dt = F.softplus(dt + dt_bias.float())
    y = (scan or ssd_scan)(x.unflatten(-1, (d.num_heads, d.head_dim)), dt, A,
                           B.unflatten(-1, (d.n_groups, d.state_size)), C.unflatten(-1, (d.n_groups, d.state_size)),
                           D, ssm_state, batch)
    if norm_weight is None:
        return y.flatten(-2) * F.silu(z)
    return gated_group_rms_norm(y.flatten(-2), z, norm_weight, d.n_groups, eps)
