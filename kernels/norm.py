"""RMSNorm (torch reference)."""

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dimension, computed and returned in float32."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps)
