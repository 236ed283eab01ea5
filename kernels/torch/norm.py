"""RMSNorm (torch reference)."""

import torch
import torch.nn.functional as F


_PROMOTE_TO_FLOAT32 = (torch.float32, torch.bfloat16, torch.float16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dimension, computed and returned in float32."""
    return F.rms_norm(x if x.dtype == torch.float32 else x.float(), (x.shape[-1],), weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = residual + x (in residual's dtype); returns (rms_norm(new_residual) in out_dtype, new_residual)."""
    if residual.dtype == torch.float32 and x.dtype in _PROMOTE_TO_FLOAT32:
        new_residual = residual + x  # type promotion widens x exactly: the same sum without a float32 copy of x
    else:
        new_residual = (residual.float() + x.float()).to(residual.dtype)
    return rms_norm(new_residual, weight, eps).to(out_dtype), new_residual


def scaled_norm_add(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float, a: float, b: float,
                    c: float) -> torch.Tensor:
    """(rms_norm(x * a) * weight + y * b) * c over the last dimension, in float32 (Gemma 4's per-layer inputs)."""
    return (rms_norm(x.float() * a, weight, eps) + y.float() * b) * c
