"""The native SSD (Mamba-2) recurrence (kernels/cpu/src/ssd.c, cpu_native.ssd_rule) against its torch twin
(kernels.torch.mamba2.ssd_scan: one-step update for decode rows, chunked scan for prompts), on every variant this
CPU runs: the same outputs and states, in place in the slots of a pool view, other slots untouched, the same whatever
else is in the batch."""

from __future__ import annotations

import pytest
import torch

from edgeserve.kernels import dispatch
from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.torch import mamba2 as m2
from edgeserve.kernels.torch.gated_delta import DeltaBatch

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no native CPU kernels here")
H, P, N, G = 8, 16, 24, 2  # N: one AVX2 block of 16 and a tail of 8


@pytest.fixture(scope="module", params=cpu_native.supported_variants() if cpu_native.available() else [])
def lib(request):
    return cpu_native.load(request.param)


def inputs(t: int, seed: int = 0):
    """x [T, H, P], B, C [T, G, N] as column views of one conv output (rows H P + 2 G N apart), dt [T, H] > 0, A < 0,
    D [H]."""
    g = torch.Generator().manual_seed(seed)
    xbc = torch.randn(t, H * P + 2 * G * N, generator=g)
    x, b, c = xbc.split([H * P, G * N, G * N], dim=-1)
    dt = torch.nn.functional.softplus(torch.randn(t, H, generator=g))
    A = -torch.rand(H, generator=g) * 4 - 0.1
    D = torch.randn(H, generator=g)
    return x.unflatten(-1, (H, P)), dt, A, b.unflatten(-1, (G, N)), c.unflatten(-1, (G, N)), D


def pool(slots: int, seed: int = 1) -> torch.Tensor:
    """A layer's view of a [slots, layers, H, P, N] pool: slot stride of two layers."""
    return torch.randn(slots, 2, H, P, N, generator=torch.Generator().manual_seed(seed))[:, 1]


def close(a: torch.Tensor, e: torch.Tensor, tol: float = 1e-5) -> None:
    assert a.shape == e.shape and torch.isfinite(a).all()
    assert ((a - e).abs() <= tol * (e.abs() + e.abs().max())).all(), (a - e).abs().max()


@pytest.mark.parametrize("lens", [[1, 1, 1], [5, 1, 9], [1, 0, 3]])
def test_native_matches_the_torch_twin_and_leaves_other_slots_alone(lib, lens):
    x, dt, A, b, c, D = inputs(sum(lens))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    slots = torch.tensor([3, 0, 2])
    batch = DeltaBatch.build(cu, slots)
    ours, twin = pool(5), pool(5)
    y = cpu_native.ssd_rule(x, dt, A, b, c, D, ours, batch, lib=lib)
    want = m2.ssd_scan(x, dt, A, b, c, D, twin, batch)
    close(y, want)
    close(ours, twin)
    assert torch.equal(ours[1], pool(5)[1]) and torch.equal(ours[4], pool(5)[4])  # slots of no sequence


def test_native_is_batch_invariant(lib):
    lens, slots = [4, 1, 6], torch.tensor([1, 2, 0])
    x, dt, A, b, c, D = inputs(sum(lens), seed=3)
    cu = torch.tensor([0, 4, 5, 11])
    together = pool(3)
    y = cpu_native.ssd_rule(x, dt, A, b, c, D, together, DeltaBatch.build(cu, slots), lib=lib)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        alone = pool(3)
        y1 = cpu_native.ssd_rule(x[s:e], dt[s:e], A, b[s:e], c[s:e], D, alone,
                                 DeltaBatch.build(torch.tensor([0, e - s]), slots[i:i + 1]), lib=lib)
        assert torch.equal(y1, y[s:e]) and torch.equal(alone[slots[i]], together[slots[i]])


def test_native_declines_what_it_does_not_take(lib):
    x, dt, A, b, c, D = inputs(3)
    batch = DeltaBatch.build(torch.tensor([0, 3]), torch.tensor([0]))
    assert cpu_native.ssd_rule(x.double(), dt, A, b, c, D, pool(1), batch, lib=lib) is None
    assert cpu_native.ssd_rule(x, dt, A, b, c, D, pool(1).double(), batch, lib=lib) is None
    assert cpu_native.ssd_rule(x.contiguous(), dt, A, b, c, D, pool(1), batch, lib=lib) is None  # rows not shared
    with pytest.raises(ValueError, match="ssm state"):
        cpu_native.ssd_rule(x, dt, A, b, c, D, pool(1)[:, :4], batch, lib=lib)


def test_dispatch_runs_the_mixer_natively_with_the_twins_result():
    """mamba2_mixer with dispatch.ssd_scan (what the models pass) gives ssd_scan's output and states."""
    dims = m2.Mamba2Dims(H, P, N, G, 4)
    g = torch.Generator().manual_seed(5)
    t = 6
    zxbcdt = torch.randn(t, dims.in_proj_dim, generator=g)
    conv_w, conv_b = torch.randn(dims.conv_dim, 4, generator=g) * 0.3, torch.randn(dims.conv_dim, generator=g)
    dt_bias, A, D, norm = torch.randn(H, generator=g), -torch.rand(H, generator=g) - 0.1, torch.randn(H), \
        torch.ones(H * P)
    batch = DeltaBatch.build(torch.tensor([0, 5, 6]), torch.tensor([1, 0]))
    out = []
    for scan in (None, dispatch.ssd_scan):
        conv, ssm = torch.zeros(2, 3, dims.conv_dim), torch.zeros(2, H, P, N)
        out.append((m2.mamba2_mixer(zxbcdt, dims, conv_w, conv_b, dt_bias, A, D, norm, 1e-5, conv, ssm, batch,
                                    scan), ssm))
    close(out[1][0], out[0][0], 1e-4)
    close(out[1][1], out[0][1])


@pytest.mark.skipif(__import__("os").uname().machine not in ("x86_64", "i686"), reason="the flush is x86's MXCSR")
def test_native_flushes_subnormal_states_and_restores_the_thread(lib):
    """A state of subnormal floats (what long decays leave; each multiply on one is a slow microcode assist) is read
    as zero, and the calling thread's floating-point mode is left as it was (torch keeps its subnormals)."""
    x, dt, A, b, c, D = inputs(2)
    x.zero_()  # no new input: y is the old state's read-out, which reads as zero (and D x is 0)
    cu, slots = torch.tensor([0, 2]), torch.tensor([1])
    state = pool(3)
    state[1] = 1e-39
    y = cpu_native.ssd_rule(x, dt, A, b, c, D, state, DeltaBatch.build(cu, slots), lib=lib)
    assert torch.count_nonzero(y) == 0 and torch.count_nonzero(state[1]) == 0
    assert torch.equal(state[0], pool(3)[0])  # other slots untouched
    assert (torch.tensor([1e-39]) * torch.tensor([1.0])).item() != 0.0
