"""RMSNorm and RMSNorm fused with the residual add, in Triton (twins: `norm.rms_norm`, `norm.add_rms_norm`)."""

from __future__ import annotations

import torch

from edgeserve.kernels.triton.runtime import next_pow2, tl, triton


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                         stride_x, stride_res, stride_out, stride_res_out,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        # the stream is kept in the residual's dtype; the norm reads the value as stored
        x_stored = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + cols, x_stored, mask=mask)
        x = x_stored.to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * (1.0 / tl.sqrt(var + eps)) * w
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.shape[-1]
    xr = _rows(x)
    out = torch.empty(xr.shape, dtype=out_dtype, device=x.device)
    res_in = _rows(residual) if residual is not None else xr
    res_out = torch.empty(res_in.shape, dtype=res_in.dtype, device=x.device) if residual is not None else out
    if xr.shape[0]:
        _add_rms_norm_kernel[(xr.shape[0],)](
            xr, res_in, weight, out, res_out, n, eps, xr.stride(0), res_in.stride(0), out.stride(0), res_out.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=next_pow2(n), num_warps=min(16, max(1, next_pow2(n) // 512)),
        )
    shape = x.shape
    return out.reshape(shape), (res_out.reshape(shape) if residual is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dimension, computed and returned in float32."""
    return _launch(x, None, weight, eps, torch.float32)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = residual + x (in residual's dtype); returns (rms_norm(new_residual) in out_dtype, new_residual)."""
    out, res = _launch(x, residual, weight, eps, out_dtype)
    assert res is not None
    return out, res
