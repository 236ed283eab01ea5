"""The fused stack's Mamba-2 mixer block (kernels/cpu/src/mamba2.c, qmm_ssd_mix) against its torch twin
(kernels.torch.mamba2.mamba2_mixer) on every variant this CPU runs: the same gated, normed output and the same conv
and SSM states, updated in place in one layer of [slots, layers, ...] pools, other slots and layers untouched, the
same rows whatever else is in the batch."""

from __future__ import annotations

import ctypes

import pytest
import torch

from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.cpu.blocks import GdnStep, SsdLayer
from edgeserve.kernels.torch import mamba2 as m2
from edgeserve.kernels.torch.gated_delta import DeltaBatch

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no native CPU kernels here")
DIMS = m2.Mamba2Dims(num_heads=8, head_dim=16, state_size=24, n_groups=2, conv_kernel=4)
LAYERS, INDEX, SLOTS, EPS = 2, 1, 5, 1e-5


@pytest.fixture(scope="module", params=cpu_native.supported_variants() if cpu_native.available() else [])
def lib(request):
    return cpu_native.load(request.param)


def weights(seed: int = 0, norm: bool = True, bias: bool = True) -> dict:
    """A random mixer's small weights (A < 0)."""
    g, d = torch.Generator().manual_seed(seed), DIMS
    return {"conv": torch.randn(d.conv_dim, d.conv_kernel, generator=g) * 0.4,
            "conv_bias": torch.randn(d.conv_dim, generator=g) * 0.2 if bias else None,
            "dt_bias": torch.randn(d.num_heads, generator=g), "A": -torch.rand(d.num_heads, generator=g) * 3 - 0.1,
            "D": torch.randn(d.num_heads, generator=g),
            "norm": torch.rand(d.inner, generator=g) + 0.5 if norm else None}


def pools(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Conv [slots, layers, K - 1, C] and SSM [slots, layers, H, P, N] pools of random states."""
    g, d = torch.Generator().manual_seed(seed), DIMS
    return (torch.randn(SLOTS, LAYERS, d.conv_kernel - 1, d.conv_dim, generator=g),
            torch.randn(SLOTS, LAYERS, d.num_heads, d.head_dim, d.state_size, generator=g) * 0.3)


def native_mix(lib, proj: torch.Tensor, w: dict, conv: torch.Tensor, ssm: torch.Tensor, cu: list[int],
               slots: list[int]) -> torch.Tensor:
    """qmm_ssd_mix of proj [T, in_proj_dim] over layer INDEX of the pools (in place)."""
    d, t = DIMS, proj.shape[0]
    ptr = lambda x: None if x is None else x.data_ptr()  # noqa: E731
    layer = SsdLayer(d.num_heads, d.head_dim, d.state_size, d.n_groups, d.conv_kernel, INDEX, EPS, ptr(w["conv"]),
                     ptr(w["conv_bias"]), ptr(w["dt_bias"]), ptr(w["A"]), ptr(w["D"]), ptr(w["norm"]))
    cu_t, sl_t = torch.tensor(cu, dtype=torch.int32), torch.tensor(slots, dtype=torch.int32)
    step = GdnStep(conv.data_ptr(), conv.stride(0), conv.stride(1), ssm.data_ptr(), ssm.stride(0), ssm.stride(1),
                   cu_t.data_ptr(), sl_t.data_ptr(), len(slots))
    scratch = torch.empty(t, d.inner + 2 * d.n_groups * d.state_size + d.num_heads)
    out = torch.empty(t, d.inner)
    lib.qmm_ssd_mix(ctypes.byref(layer), ctypes.byref(step), t, proj.data_ptr(), proj.stride(0), scratch.data_ptr(),
                    out.data_ptr())
    return out


def twin_mix(proj: torch.Tensor, w: dict, conv: torch.Tensor, ssm: torch.Tensor, cu: list[int],
             slots: list[int]) -> torch.Tensor:
    """mamba2_mixer (torch) over the same layer's states."""
    batch = DeltaBatch.build(torch.tensor(cu), torch.tensor(slots))
    layer_conv, layer_ssm = conv[:, INDEX].clone(), ssm[:, INDEX].clone()
    y = m2.mamba2_mixer(proj, DIMS, w["conv"], w["conv_bias"], w["dt_bias"], w["A"], w["D"], w["norm"], EPS,
                        layer_conv, layer_ssm, batch)
    conv[:, INDEX], ssm[:, INDEX] = layer_conv, layer_ssm
    return y


def close(a: torch.Tensor, e: torch.Tensor, tol: float = 2e-4) -> None:
    assert a.shape == e.shape and torch.isfinite(a).all()
    assert ((a - e).abs() <= tol * (e.abs() + e.abs().max())).all(), (a - e).abs().max()


@pytest.mark.parametrize("lens", [[1, 1, 1], [7, 1, 2], [1, 0, 5], [70, 3, 1]])
@pytest.mark.parametrize("norm", [True, False])
def test_block_matches_the_torch_twin(lib, lens, norm):
    t = sum(lens)
    cu, slots = [0, *torch.tensor(lens).cumsum(0).tolist()], [3, 0, 2]
    proj = torch.randn(t, DIMS.in_proj_dim + 5, generator=torch.Generator().manual_seed(7))[:, :DIMS.in_proj_dim]
    w = weights(norm=norm, bias=norm)
    (conv, ssm), (tconv, tssm) = pools(), pools()
    y = native_mix(lib, proj, w, conv, ssm, cu, slots)
    want = twin_mix(proj, w, tconv, tssm, cu, slots)
    close(y, want)
    close(conv, tconv, 1e-6)
    close(ssm, tssm)
    fresh_conv, fresh_ssm = pools()
    assert torch.equal(conv[:, 0], fresh_conv[:, 0]) and torch.equal(ssm[:, 0], fresh_ssm[:, 0])  # another layer
    assert torch.equal(ssm[1], fresh_ssm[1]) and torch.equal(conv[4], fresh_conv[4])  # slots of no sequence


def test_block_is_batch_invariant(lib):
    lens, slots = [5, 1, 9], [1, 2, 0]
    cu = [0, 5, 6, 15]
    proj = torch.randn(15, DIMS.in_proj_dim, generator=torch.Generator().manual_seed(3))
    w = weights(seed=2)
    conv, ssm = pools()
    together = native_mix(lib, proj, w, conv, ssm, cu, slots)
    for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        aconv, assm = pools()
        alone = native_mix(lib, proj[s:e], w, aconv, assm, [0, e - s], [slots[i]])
        assert torch.equal(alone, together[s:e])
        assert torch.equal(assm[slots[i]], ssm[slots[i]]) and torch.equal(aconv[slots[i]], conv[slots[i]])
