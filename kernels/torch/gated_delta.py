"""Gated DeltaNet, the linear-attention layer of the Qwen3.5 / 3.6 hybrids (torch twins, float32).

Every function works on a flat ragged batch (a `DeltaBatch`, built and checked once per step for all layers): the
step's tokens of all sequences back to back, sequence i owning rows cu_seqlens[i]:cu_seqlens[i + 1] (a sequence
of no rows is allowed and changes nothing), and reading and writing its states at `slots[i]` of preallocated pools
(edgeserve.engine.cache.state_pool):

- conv state [num_slots, K - 1, C]: the last K - 1 inputs of the causal depthwise convolution (time-major: one
  row of C channels per position, oldest first), zeros for a fresh sequence;
- recurrent state [num_slots, Hv, Dk, Dv] float32: per value head the k_dim x v_dim matrix S of the delta rule.

The pools may be views with any slot stride (a layer of a [num_slots, num_layers, ...] pool) as long as each
slot's block is contiguous. Heads: num_v_heads is a multiple of num_k_heads and value head h reads query/key head
h // (num_v_heads // num_k_heads), as transformers' Qwen3_5GatedDeltaNet does ("grouped"), or with `tiled` head
h % num_k_heads: llama.cpp's qwen35 / qwen35moe GGUFs store the value heads (and z, a, b, A, dt_bias, out_proj's
columns) in that tiled order, so a GGUF model runs with tiled=True on its weights as they are.

Per token and value head (the recurrence; q and k L2-normalized, q scaled by Dk ** -0.5):
    S = S * exp(g);  delta = beta * (v - S^T k);  S = S + k delta^T;  o = S^T q
The chunked form computes the same thing a chunk of tokens at a time with matmuls (the WY / UT transform), for
prompts; the recurrent form steps token by token, for decode. Both pad the ragged batch to [B, L] with g = 0 and
beta = 0, which leaves a state unchanged, so the padding needs no masking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from edgeserve.kernels.torch.short_conv import causal_conv1d

L2_EPS = 1e-6  # transformers' l2norm: x / sqrt(sum(x^2) + eps)


@dataclass(frozen=True)
class DeltaNetDims:
    """The shape of one Gated DeltaNet layer."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4
    tiled: bool = False  # value head h reads key head h % num_k_heads (GGUF order), not h // group (HF order)

    def __post_init__(self) -> None:
        if min(self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim, self.conv_kernel) < 1:
            raise ValueError(f"every dimension must be positive: {self}")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"num_v_heads ({self.num_v_heads}) must be a multiple of num_k_heads "
                             f"({self.num_k_heads})")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: [q | k | v] of one token."""
        return 2 * self.key_dim + self.value_dim


@dataclass
class DeltaNetWeights:
    """The layer's own small weights (the projections around it belong to the model)."""

    conv_weight: torch.Tensor  # [conv_dim, K] (transformers' conv1d.weight [C, 1, K] squeezed)
    A_log: torch.Tensor  # [Hv]: the decay rate is exp(A_log)
    dt_bias: torch.Tensor  # [Hv]
    norm_weight: torch.Tensor  # [Dv]: the gated RMSNorm's weight (used as is, not 1 + w)
    norm_eps: float = 1e-6


# --- the ragged batch ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DeltaBatch:
    """One step's ragged batch: sequence i owns token rows cu_seqlens[i] .. cu_seqlens[i + 1] - 1 and state slot
    slots[i]. Build it with `DeltaBatch.build` (which checks it) once per step; every linear layer shares it."""

    cu_seqlens: torch.Tensor  # int32 [B + 1]
    slots: torch.Tensor  # int32 [B], distinct
    seq: torch.Tensor  # int64 [T]: each token's sequence
    pos: torch.Tensor  # int64 [T]: its position in the sequence
    lens: torch.Tensor  # int64 [B]
    max_len: int
    slot_bound: int  # 1 + the highest slot (0 without sequences)

    @property
    def num_tokens(self) -> int:
        return self.seq.numel()

    @classmethod
    def build(cls, cu_seqlens, slots, num_slots: int | None = None) -> "DeltaBatch":
        """The batch of cu_seqlens [B + 1] (from 0, never decreasing) and distinct slots [B] (below num_slots when
        given), tensors or lists; ValueError otherwise (two sequences writing one slot would race)."""
        cu, sl = (x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.int64) for x in (cu_seqlens, slots))
        if cu.dim() != 1 or cu.numel() < 1 or cu.is_floating_point():
            raise ValueError("cu_seqlens must be a 1-D integer tensor [num_seqs + 1]")
        if sl.dim() != 1 or sl.is_floating_point() or sl.numel() != cu.numel() - 1:
            raise ValueError(f"slots must be a 1-D integer tensor with one slot per sequence ({cu.numel() - 1}), "
                             f"got shape {tuple(sl.shape)}")
        cu, sl = cu.to(torch.int64), sl.to(torch.int64)
        lens = cu[1:] - cu[:-1]
        if int(cu[0]) != 0 or bool((lens < 0).any()):
            raise ValueError(f"cu_seqlens must start at 0 and never decrease: {cu.tolist()[:16]}")
        bound = int(sl.max()) + 1 if sl.numel() else 0
        if sl.numel() and int(sl.min()) < 0:
            raise ValueError(f"slots must lie in 0..num_slots - 1, not below: {sl.tolist()[:16]}")
        if num_slots is not None and bound > num_slots:
            raise ValueError(f"slots must lie in 0..{num_slots - 1}: {sl.tolist()[:16]}")
        if sl.unique().numel() != sl.numel():
            raise ValueError("two sequences of one batch share a state slot")
        total = int(cu[-1])
        seq = torch.repeat_interleave(torch.arange(lens.numel(), device=cu.device), lens, output_size=total)
        pos = torch.arange(total, device=cu.device) - cu[:-1][seq]
        return cls(cu.to(torch.int32).contiguous(), sl.to(torch.int32).contiguous(), seq, pos, lens,
                   int(lens.max()) if lens.numel() else 0, bound)

    def check_fits(self, num_tokens: int, num_slots: int) -> None:
        """ValueError unless the inputs have the batch's token count and the pool has the batch's slots."""
        if num_tokens != self.num_tokens:
            raise ValueError(f"the batch has {self.num_tokens} tokens, the inputs {num_tokens}")
        if self.slot_bound > num_slots:
            raise ValueError(f"slots must lie in 0..{num_slots - 1} (the pool's slots); the batch uses slot "
                             f"{self.slot_bound - 1}")


def _pad(x: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """Rows x [T, ...] placed at [B, L, ...] (zeros elsewhere)."""
    out = x.new_zeros(batch, length, *x.shape[1:])
    out[seq, pos] = x
    return out


# --- the convolution -----------------------------------------------------------------------------------------

def causal_conv1d_silu(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                       batch: DeltaBatch) -> torch.Tensor:
    """SiLU of the causal depthwise convolution of x [T, C] with weight [C, K] (no bias), each sequence continuing
    from the K - 1 inputs in its conv state; writes each sequence's last K - 1 inputs back. Returns float32 [T, C]."""
    return F.silu(causal_conv1d(x, weight, conv_state, batch))


# --- the gated delta rule ------------------------------------------------------------------------------------

def delta_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) [T, Hv] float32 from the projections a, b [T, Hv]: the log-decay g = -exp(A_log) *
    softplus(a + dt_bias) (always <= 0) and the write strength beta = sigmoid(b)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dimension, in float32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def check_rule_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, batch: DeltaBatch) -> None:
    """Raise ValueError unless the inputs of `gated_delta_rule` fit each other, the state pool and the batch."""
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if k.shape != q.shape or v.shape[0] != t or hv % hk or g.shape != (t, hv) or beta.shape != (t, hv):
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
                         f"g {tuple(g.shape)} beta {tuple(beta.shape)}")
    if tuple(state.shape[1:]) != (hv, dk, dv):
        raise ValueError(f"recurrent state {tuple(state.shape)} must be [num_slots, {hv}, {dk}, {dv}]")
    batch.check_fits(t, state.shape[0])


def _prepare(q, k, v, g, beta, state, batch, scale, tiled):
    """Check shapes, normalize and scale q / k, repeat them to the value heads and pad all to [B, L, ...]."""
    check_rule_shapes(q, k, v, g, beta, state, batch)
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    scale = dk ** -0.5 if scale is None else scale
    group = hv // hk
    qn, kn = l2norm(q) * scale, l2norm(k)
    qn, kn = (qn.repeat(1, group, 1), kn.repeat(1, group, 1)) if tiled else (
        qn.repeat_interleave(group, dim=1), kn.repeat_interleave(group, dim=1))
    padded = [_pad(x, batch.seq, batch.pos, batch.lens.numel(), batch.max_len)
              for x in (qn, kn, v.float(), g.float(), beta.float())]
    return padded, batch.slots.long()


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor, batch: DeltaBatch, scale: float | None = None,
                               tiled: bool = False) -> torch.Tensor:
    """The gated delta rule token by token: q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv]; each sequence starts
    from and writes back its state [num_slots, Hv, Dk, Dv]; `tiled`: the GGUF head order (module docstring).
    Returns o [T, Hv, Dv] float32. (Steps over positions for all sequences at once: one step for a decode batch.)"""
    (qp, kp, vp, gp, bp), slots = _prepare(q, k, v, g, beta, state, batch, scale, tiled)
    s = state[slots].float()  # [B, H, Dk, Dv]
    out = torch.empty_like(vp)
    for i in range(vp.shape[1]):
        s = s * gp[:, i].exp()[:, :, None, None]
        delta = (vp[:, i] - torch.einsum("bhkv,bhk->bhv", s, kp[:, i])) * bp[:, i, :, None]
        s = s + kp[:, i, :, :, None] * delta[:, :, None, :]
        out[:, i] = torch.einsum("bhkv,bhk->bhv", s, qp[:, i])
    state[slots] = s.to(state.dtype)
    return out[batch.seq, batch.pos]


def gated_delta_rule_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          state: torch.Tensor, batch: DeltaBatch, scale: float | None = None,
                          tiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """recurrent_gated_delta_rule also keeping each sequence's state after each of its rows (for speculative
    verification: a partly accepted run of drafts restores its last accepted row's state instead of computing the
    rows again): (o [T, Hv, Dv], row states [T, Hv, Dk, Dv] float32). Each row runs as a one-row batch."""
    cu, slots = batch.cu_seqlens.tolist(), batch.slots
    out = torch.empty(v.shape, dtype=torch.float32)
    rows = torch.empty(v.shape[0], v.shape[1], q.shape[2], v.shape[2], dtype=torch.float32)
    for b in range(len(cu) - 1):
        one = DeltaBatch.build(torch.tensor([0, 1]), slots[b: b + 1], state.shape[0])
        for t in range(cu[b], cu[b + 1]):
            out[t: t + 1] = recurrent_gated_delta_rule(q[t: t + 1], k[t: t + 1], v[t: t + 1], g[t: t + 1],
                                                       beta[t: t + 1], state, one, scale, tiled)
            rows[t] = state[slots[b]].float()
    return out, rows


def chunked_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, state: torch.Tensor, batch: DeltaBatch, scale: float | None = None,
                             chunk_size: int = 64, tiled: bool = False) -> torch.Tensor:
    """recurrent_gated_delta_rule's result computed `chunk_size` tokens at a time with matmuls (for prompts)."""
    if chunk_size < 1:
        raise ValueError("chunk_size must be positive")
    (qp, kp, vp, gp, bp), slots = _prepare(q, k, v, g, beta, state, batch, scale, tiled)
    num_seqs, length, heads, dv = vp.shape
    n = -(-length // chunk_size)
    pad = n * chunk_size - length

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, L, H, ...] -> [B, H, N, C, ...]
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        x = x.reshape(num_seqs, n, chunk_size, heads, *x.shape[3:])
        return x.movedim(3, 1)

    qc, kc, vc = chunks(qp), chunks(kp), chunks(vp)  # [B, H, N, C, D]
    gc, bc = chunks(gp.unsqueeze(-1)).squeeze(-1), chunks(bp.unsqueeze(-1)).squeeze(-1)  # [B, H, N, C]
    gamma = gc.cumsum(-1)  # log of the decay from the chunk's start through each position
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # decay[t, s] = exp(gamma_t - gamma_s) for s <= t, else 0 (masked before exp: no overflow)
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    kk = kc @ kc.transpose(-1, -2)
    # u = delta of each position: (I + A) u = beta (v - exp(gamma) k S0), A strictly lower
    a = (bc[..., None] * kk * decay).tril(-1)
    eye = torch.eye(chunk_size, dtype=a.dtype, device=a.device)
    solve = lambda rhs: torch.linalg.solve_triangular(a + eye, rhs, upper=False, unitriangular=True)  # noqa: E731
    u_v = solve(bc[..., None] * vc)
    u_s = solve(bc[..., None] * gamma.exp()[..., None] * kc)  # times S0, per chunk
    attn = (qc @ kc.transpose(-1, -2)) * decay  # q_t . k_s exp(gamma_t - gamma_s), s <= t
    q_decayed = qc * gamma.exp()[..., None]
    k_to_end = kc * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()[..., None, None]
    s = state[slots].float()
    out = torch.empty_like(vc)
    for i in range(n):
        u = u_v[:, :, i] - u_s[:, :, i] @ s
        out[:, :, i] = q_decayed[:, :, i] @ s + attn[:, :, i] @ u
        s = s * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ u
    state[slots] = s.to(state.dtype)
    out = out.movedim(1, 3).reshape(num_seqs, n * chunk_size, heads, dv)
    return out[batch.seq, batch.pos]


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, batch: DeltaBatch, scale: float | None = None,
                     tiled: bool = False) -> torch.Tensor:
    """The gated delta rule in whichever form suits the batch: recurrent when no sequence has more than a few
    tokens (decode), chunked otherwise."""
    if batch.max_len <= 4:
        return recurrent_gated_delta_rule(q, k, v, g, beta, state, batch, scale, tiled)
    return chunked_gated_delta_rule(q, k, v, g, beta, state, batch, scale, tiled=tiled)


# --- the output norm and the whole layer ----------------------------------------------------------------------

def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(o) * weight * SiLU(z) over the last dimension (Qwen3.5's RMSNormGated), float32."""
    return F.rms_norm(o.float(), (o.shape[-1],), weight.float(), eps) * F.silu(z.float())


Conv = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, DeltaBatch], torch.Tensor]
Rule = Callable[..., torch.Tensor]
Norm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
Gates = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def gated_delta_net(mixed_qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    weights: DeltaNetWeights, dims: DeltaNetDims, conv_state: torch.Tensor,
                    recurrent_state: torch.Tensor, batch: DeltaBatch, conv: Conv = causal_conv1d_silu,
                    rule: Rule = gated_delta_rule, norm: Norm = gated_rms_norm,
                    gates: Gates = delta_gates) -> torch.Tensor:
    """The layer between its projections: mixed_qkv [T, conv_dim] (in_proj_qkv's output), z [T, value_dim]
    (in_proj_z), a, b [T, Hv] (in_proj_a, in_proj_b) -> [T, value_dim] float32 for out_proj, updating both
    states of each sequence's slot. `conv` / `rule` / `norm` / `gates`: the kernels to run (kernels.dispatch passes
    native ones). z may be a view with any row stride (the projection's columns as they are)."""
    t = mixed_qkv.shape[0]
    x = conv(mixed_qkv, weights.conv_weight, conv_state, batch)
    q, k, v = x.split([dims.key_dim, dims.key_dim, dims.value_dim], dim=-1)
    q = q.reshape(t, dims.num_k_heads, dims.head_k_dim)
    k = k.reshape(t, dims.num_k_heads, dims.head_k_dim)
    v = v.reshape(t, dims.num_v_heads, dims.head_v_dim)
    g, beta = gates(a, b, weights.A_log, weights.dt_bias)
    o = rule(q, k, v, g, beta, recurrent_state, batch, tiled=dims.tiled)
    z = z.unflatten(-1, (dims.num_v_heads, dims.head_v_dim))  # a view, whatever z's row stride
    out = norm(o, z, weights.norm_weight, weights.norm_eps)
    return out.reshape(t, dims.value_dim)
