"""SiLU-and-mul in Triton (twin: `activation.silu_and_mul`)."""

from __future__ import annotations

import torch

from edgeserve.kernels.triton.runtime import next_pow2, tl, triton


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    base = x_ptr + row.to(tl.int64) * stride_x
    gate = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row.to(tl.int64) * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, where the last dimension is [gate | up]; computed in float32, returned in the input dtype."""
    n = gate_up.shape[-1] // 2
    x = gate_up.reshape(-1, 2 * n)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], n, dtype=gate_up.dtype, device=gate_up.device)
    if x.shape[0] and n:
        block = min(1024, next_pow2(n))
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(n, block))](x, out, n, x.stride(0), out.stride(0), BLOCK=block)
    return out.reshape(*gate_up.shape[:-1], n)
