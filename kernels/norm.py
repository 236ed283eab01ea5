"""RMSNorm (torch reference)."""

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dimension, computed and returned in float32."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = residual + x (in residual's dtype); returns (rms_norm(new_residual) in out_dtype, new_residual)."""
    new_residual = (residual.float() + x.float()).to(residual.dtype)
    return rms_norm(new_residual, weight, eps).to(out_dtype), new_residual
