"""kernels.torch.short_conv: the causal depthwise convolution over ragged batches with per-slot conv states equals
torch's conv1d over each whole sequence however the sequence is cut into steps (prompt chunks, single-token decode
steps, batched with others), the decode path bit for bit the general one; the gated short convolution is
c * conv(b * x); and the native kernel (kernels/cpu/src/short_conv.c, the fused stack's conv mixer) matches the twin on
every variant this CPU runs, updating the states of its slots in place in a pool view and no others."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.torch.gated_delta import DeltaBatch
from edgeserve.kernels.torch.short_conv import _one_token_each, _ragged, causal_conv1d, gated_short_conv

C, K = 24, 3


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """conv1d of one whole sequence x [L, C] (zeros before it), causal: [L, C]."""
    return F.conv1d(x.T[None], w[:, None], padding=K - 1, groups=C)[0, :, : x.shape[0]].T


def test_any_cut_of_the_sequences_gives_the_whole_sequences_conv() -> None:
    torch.manual_seed(0)
    w = torch.randn(C, K)
    seqs = [torch.randn(n, C) for n in (9, 4, 13)]
    slots = [3, 0, 5]
    state = torch.zeros(6, K - 1, C)
    # steps: per sequence the number of rows it runs (0: not in the step)
    steps = [(5, 1, 6), (1, 1, 0), (1, 2, 7), (2, 0, 0), (0, 0, 0)]
    done = [0, 0, 0]
    outs: list[list[torch.Tensor]] = [[], [], []]
    for step in steps:
        rows = [seqs[i][done[i]:done[i] + n] for i, n in enumerate(step)]
        cu = torch.tensor([0, *torch.tensor(step).cumsum(0).tolist()])
        y = causal_conv1d(torch.cat(rows), w, state, DeltaBatch.build(cu, slots, 6))
        for i, n in enumerate(step):
            outs[i].append(y[int(cu[i]):int(cu[i + 1])])
            done[i] += n
    for i, x in enumerate(seqs):
        assert torch.allclose(torch.cat(outs[i]), reference(x, w), atol=1e-5)
        assert torch.equal(state[slots[i]], x[-(K - 1):])  # the state: the sequence's last K - 1 inputs


def test_a_decode_step_takes_the_one_token_path_bit_for_bit() -> None:
    torch.manual_seed(1)
    x, w, state = torch.randn(4, C), torch.randn(C, K), torch.randn(8, K - 1, C)
    batch = DeltaBatch.build([0, 1, 2, 3, 4], [5, 1, 7, 2], 8)
    a, b = state.clone(), state.clone()
    assert torch.equal(_ragged(x, w, a, batch), _one_token_each(x, w, b, batch.slots.long()))
    assert torch.equal(a, b) and not torch.equal(a, state)


def test_gated_short_conv_is_c_times_the_conv_of_b_times_x() -> None:
    torch.manual_seed(2)
    bcx, w = torch.randn(7, 3 * C), torch.randn(C, K)
    b, c, x = bcx.chunk(3, dim=-1)
    y = gated_short_conv(bcx, w, torch.zeros(1, K - 1, C), DeltaBatch.build([0, 7], [0], 1))
    assert torch.allclose(y, c * reference(b * x, w), atol=1e-5)


@pytest.fixture(scope="module", params=cpu_native.supported_variants() if cpu_native.available() else [])
def lib(request):
    return cpu_native.load(request.param)


@pytest.mark.parametrize("lens", [[1, 1, 1], [5, 1, 9], [1, 0, 3], [2, 1, 1]])
def test_native_matches_the_twin_in_place_in_the_pool(lib, lens) -> None:
    gen = torch.Generator().manual_seed(3)
    t = sum(lens)
    # the projection's rows as a column view (a row stride wider than 3C); the pool [slots, layers, K - 1, C], layer 1
    bcx = torch.randn(t, 3 * C + 5, generator=gen)[:, 2:2 + 3 * C]
    w = torch.randn(C, K, generator=gen)
    pool = torch.randn(5, 2, K - 1, C, generator=gen)
    ours, twin = pool.clone(), pool.clone()
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    batch = DeltaBatch.build(cu, [3, 0, 2], 5)
    y = cpu_native.short_conv(bcx, w, ours[:, 1], batch, lib=lib)
    want = gated_short_conv(bcx, w, twin[:, 1], batch)
    assert y is not None and torch.allclose(y, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(ours, twin)  # the same last inputs (products b * x, no sums) in the same slots
    assert not torch.equal(ours[[3, 0, 2], 1], pool[[3, 0, 2], 1]) or not any(lens)
    assert torch.equal(ours[[1, 4]], pool[[1, 4]]) and torch.equal(ours[:, 0], pool[:, 0])  # other slots and layers
