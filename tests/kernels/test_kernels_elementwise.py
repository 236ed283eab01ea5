"""Triton RMSNorm (+ residual add), RoPE fused with the paged K/V write, and SiLU-and-mul against their twins."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICES, assert_close, kernel_device

from edgeserve.kernels import dispatch
from edgeserve.kernels.torch.activation import silu_and_mul
from edgeserve.kernels.torch.norm import add_rms_norm, rms_norm
from edgeserve.kernels.torch.rope import rope_cos_sin, rope_inv_freq, rope_write_kv

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])


def randn(*shape: int, seed: int = 0, dtype=torch.float32, device="cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
@DTYPES
@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 65), (3, 576)])
def test_rms_norm(device, dtype, rows, hidden):
    device = kernel_device(device)
    x, w = randn(rows, hidden, seed=1, dtype=dtype, device=device), randn(hidden, seed=2, device=device)
    with dispatch.force_backend("triton"):
        y = dispatch.rms_norm(x, w, 1e-6)
    assert y.dtype == torch.float32
    assert_close(y, rms_norm(x.cpu(), w.cpu(), 1e-6), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@DTYPES
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 97)])
def test_add_rms_norm(device, dtype, rows, hidden):
    """The residual stays float32 (as in the model), x and the normed output in the compute dtype."""
    device = kernel_device(device)
    x = randn(rows, hidden, seed=3, dtype=dtype, device=device)
    residual = randn(rows, hidden, seed=4, device=device)
    w = randn(hidden, seed=5, device=device)
    with dispatch.force_backend("triton"):
        normed, new_residual = dispatch.add_rms_norm(x, residual, w, 1e-5, out_dtype=dtype)
    ref_normed, ref_residual = add_rms_norm(x.cpu(), residual.cpu(), w.cpu(), 1e-5, torch.float32)
    assert normed.dtype == dtype and new_residual.dtype == torch.float32
    assert_close(new_residual, ref_residual, torch.float32)
    assert_close(normed, ref_normed, dtype)


@pytest.mark.parametrize("device", DEVICES)
@DTYPES
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (6, 2, 128), (8, 1, 64)])
def test_rope_write_kv(device, dtype, heads, kv_heads, head_dim):
    """Rotated q returned, rotated k and v stored at slots that cross block boundaries; other slots untouched."""
    device = kernel_device(device)
    t, num_blocks, block_size = 7, 5, 4
    qkv = randn(t, heads + 2 * kv_heads, head_dim, seed=6, dtype=dtype, device=device)
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    positions = torch.tensor([0, 1, 2, 3, 4, 9, 130])
    cos, sin = rope_cos_sin(rope_inv_freq(head_dim, 10000.0), 256)
    cos, sin = cos[positions].to(device), sin[positions].to(device)
    slots = torch.tensor([2, 3, 4, 5, 19, 12, 0], device=device)
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    k_ref, v_ref = k_cache.cpu().clone(), v_cache.cpu().clone()
    with dispatch.force_backend("triton"):
        q_rot = dispatch.rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
    q_ref = rope_write_kv(q.cpu(), k.cpu(), v.cpu(), cos.cpu(), sin.cpu(), k_ref, v_ref, slots.cpu())
    assert q_rot.dtype == dtype
    assert_close(q_rot, q_ref, dtype)
    assert_close(k_cache, k_ref, dtype)
    assert torch.equal(v_cache.cpu(), v_ref)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots.cpu()] = True
    assert (k_cache.view(-1, kv_heads, head_dim)[~written.to(device)] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_rope_negative_slot_writes_nothing(device):
    """A padding token (slot -1, as in a padded CUDA-graph batch) rotates q but leaves the pool alone."""
    device = kernel_device(device)
    q, k, v = randn(2, 2, 64, seed=7, device=device), randn(2, 1, 64, seed=8, device=device), randn(2, 1, 64, seed=9, device=device)
    cos, sin = rope_cos_sin(rope_inv_freq(64, 10000.0), 8)
    k_cache = torch.zeros(2, 4, 1, 64, device=device)
    v_cache = torch.zeros_like(k_cache)
    with dispatch.force_backend("triton"):
        dispatch.rope_write_kv(q, k, v, cos[:2].to(device), sin[:2].to(device), k_cache, v_cache,
                               torch.tensor([5, -1], device=device))
    assert k_cache.view(-1, 64)[5].abs().sum() > 0 and v_cache.view(-1, 64)[5].abs().sum() > 0
    assert k_cache.abs().sum() == k_cache.view(-1, 64)[5].abs().sum()


@pytest.mark.parametrize("device", DEVICES)
@DTYPES
@pytest.mark.parametrize("shape", [(1, 2 * 64), (5, 2 * 37), (2, 3, 2 * 1536)])
def test_silu_and_mul(device, dtype, shape):
    device = kernel_device(device)
    x = randn(*shape, seed=10, dtype=dtype, device=device) * 3
    with dispatch.force_backend("triton"):
        y = dispatch.silu_and_mul(x)
    assert y.dtype == dtype and y.shape == (*shape[:-1], shape[-1] // 2)
    assert_close(y, silu_and_mul(x.float().cpu()), dtype)
