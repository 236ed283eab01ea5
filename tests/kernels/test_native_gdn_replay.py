"""A verification step's drafts kept off the Gated DeltaNet states (gdn_step_t.keep) and the accepted ones replayed
after it (qmm_gdn_replay): every row's output is the plain step's, and the states after the replay are bit for bit
those of a step over the kept and accepted rows alone (the conv state and the recurrent state, other slots
untouched)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.cpu.blocks import GdnLayer, GdnStep

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no native CPU kernels here")
HK, HV, DK, DV, K = 2, 4, 32, 80, 4  # Dv = 80: a full 64-column block and a partial one (AVX-512 builds)
C, VD = 2 * HK * DK + HV * DV, HV * DV
LAYERS, INDEX, SLOTS = 2, 1, 5


@pytest.fixture(scope="module", params=cpu_native.supported_variants() if cpu_native.available() else [])
def lib(request):
    return cpu_native.load(request.param)


def layer_weights(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"conv": torch.randn(C, K, generator=g) * 0.4, "A_log": torch.randn(HV, generator=g) * 0.5,
            "dt_bias": torch.randn(HV, generator=g), "norm": torch.rand(DV, generator=g) + 0.5}


def pools(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Conv [slots, layers, K - 1, C] and recurrent [slots, layers, Hv, Dk, Dv] pools of random states."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(SLOTS, LAYERS, K - 1, C, generator=g),
            torch.randn(SLOTS, LAYERS, HV, DK, DV, generator=g) * 0.3)


def gdn_layer(w: dict) -> GdnLayer:
    return GdnLayer(HK, HV, DK, DV, K, 0, INDEX, 1e-6, DK ** -0.5, w["conv"].data_ptr(), w["A_log"].data_ptr(),
                    w["dt_bias"].data_ptr(), w["norm"].data_ptr())


def gdn_step(conv: torch.Tensor, state: torch.Tensor, lens: list[int], slots: list[int],
             keep: list[int] | None = None) -> tuple[GdnStep, list]:
    """A gdn_step_t over the pools for sequences of `lens` rows in `slots` (their draft rows after keep[b], kept in a
    spec tensor, when given), and the tensors it points into (the spec tensor last)."""
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    sl = torch.tensor(slots, dtype=torch.int32)
    step = GdnStep(conv.data_ptr(), conv.stride(0), conv.stride(1), state.data_ptr(), state.stride(0),
                   state.stride(1), cu.data_ptr(), sl.data_ptr(), len(slots))
    held = [cu, sl]
    if keep is not None:
        keep_t = torch.tensor(keep, dtype=torch.int32)
        rows = max(n - k for n, k in zip(lens, keep))
        spec = torch.full((LAYERS, len(lens), rows, 2 * C + 2 * HV), float("nan"))
        step.keep, step.spec, step.spec_layer_stride, step.spec_rows = (keep_t.data_ptr(), spec.data_ptr(),
                                                                        spec.stride(0), rows)
        held += [keep_t, spec]
    return step, held


def run_mix(lib, layer: GdnLayer, step: GdnStep, proj: torch.Tensor) -> torch.Tensor:
    """qmm_gdn_mix of proj [T, C + VD + 2 HV]: its output [T, VD]."""
    t = proj.shape[0]
    scratch, out = torch.empty(t, 2 * HK * DK + 2 * VD + 2 * HV), torch.empty(t, VD)
    lib.qmm_gdn_mix(ctypes.byref(layer), ctypes.byref(step), t, proj.data_ptr(), proj.stride(0), scratch.data_ptr(),
                    out.data_ptr())
    return out


def mix(lib, w: dict, proj: torch.Tensor, lens: list[int], slots: list[int], conv: torch.Tensor,
        state: torch.Tensor, keep: list[int] | None = None, accepted: list[int] | None = None) -> torch.Tensor:
    """qmm_gdn_mix of proj [T, C + VD + 2 HV] over layer INDEX of the pools (in place), with `keep` the draft rows
    kept off the states and then `accepted` of them replayed; its output [T, VD]."""
    layer = gdn_layer(w)
    step, _held = gdn_step(conv, state, lens, slots, keep)
    out = run_mix(lib, layer, step, proj)
    if accepted is not None:
        counts = torch.tensor(accepted, dtype=torch.int32)
        lib.qmm_gdn_replay(ctypes.byref(layer), ctypes.byref(step), counts.data_ptr())
    return out


@pytest.mark.parametrize("keep,accepted", [([1, 2, 3], [2, 1, 0]), ([1, 2, 3], [0, 0, 0]), ([0, 1, 3], [3, 2, 0]),
                                           ([1, 1, 1], [3, 2, 2])])
def test_drafts_kept_off_the_states_then_replayed(lib, keep, accepted):
    lens, slots = [4, 3, 3], [3, 0, 4]
    w = layer_weights()
    proj = torch.randn(sum(lens), C + VD + 2 * HV, generator=torch.Generator().manual_seed(2))
    conv, state = pools()
    plain = mix(lib, w, proj, lens, slots, *(x.clone() for x in (conv, state)))
    got_conv, got_state = conv.clone(), state.clone()
    out = mix(lib, w, proj, lens, slots, got_conv, got_state, keep, accepted)
    assert torch.equal(out, plain)  # the drafts' outputs are the plain step's
    starts = torch.tensor([0, *lens]).cumsum(0).tolist()
    rows = [r for s, k, a in zip(starts, keep, accepted) for r in range(s, s + k + a)]
    want_conv, want_state = conv.clone(), state.clone()
    mix(lib, w, proj[rows], [k + a for k, a in zip(keep, accepted)], slots, want_conv, want_state)
    assert torch.equal(got_conv, want_conv) and torch.equal(got_state, want_state)
    assert torch.equal(got_state[[1, 2]], state[[1, 2]])  # slots outside the step untouched


def owe(step_spec: torch.Tensor, accepted: list[int]) -> tuple[list[torch.Tensor], dict]:
    """gdn_step_t owed fields for a next step whose sequence b owes accepted[b] rows of a step's spec tensor."""
    where = torch.tensor([step_spec[0, b].data_ptr() if n else 0 for b, n in enumerate(accepted)], dtype=torch.int64)
    strides = torch.full((len(accepted),), step_spec.stride(0), dtype=torch.int64)
    counts = torch.tensor(accepted, dtype=torch.int32)
    return [where, strides, counts], dict(owed=where.data_ptr(), owed_layer_stride=strides.data_ptr(),
                                          owed_n=counts.data_ptr())


def verify_then_next(lib, w, proj, lens, slots, conv, state, keep, accepted, nxt, nxt_lens, nxt_keep, owed: bool):
    """A verification step (drafts kept off the states) and the next step (rows nxt, its own drafts after nxt_keep
    when given): the accepted drafts replayed between them (qmm_gdn_replay), or owed to the next step (`owed`).
    The next step's output."""
    layer = gdn_layer(w)
    first, held = gdn_step(conv, state, lens, slots, keep)
    run_mix(lib, layer, first, proj)
    second, _held = gdn_step(conv, state, nxt_lens, slots, nxt_keep)
    if owed:
        _tensors, fields = owe(held[-1], accepted)
        for name, value in fields.items():
            setattr(second, name, value)
    else:
        counts = torch.tensor(accepted, dtype=torch.int32)
        lib.qmm_gdn_replay(ctypes.byref(layer), ctypes.byref(first), counts.data_ptr())
    return run_mix(lib, layer, second, nxt)


@pytest.mark.parametrize("accepted,nxt_lens,nxt_keep", [
    ([2, 1, 0], [1, 1, 1], None), ([2, 1, 0], [3, 3, 1], [1, 1, 1]), ([1, 0, 2], [2, 3, 1], [1, 2, 1]),
    ([0, 0, 0], [1, 2, 1], None)])
def test_owed_drafts_run_in_the_next_steps_pass(lib, accepted, nxt_lens, nxt_keep):
    """The accepted drafts owed to the next step (gdn_step_t.owed) instead of replayed after theirs: the next
    step's outputs and the states after it are bit for bit those of the replay followed by that step."""
    lens, keep, slots = [4, 3, 3], [1, 1, 1], [3, 0, 4]
    w = layer_weights()
    g = torch.Generator().manual_seed(5)
    proj = torch.randn(sum(lens), C + VD + 2 * HV, generator=g)
    nxt = torch.randn(sum(nxt_lens), C + VD + 2 * HV, generator=g)
    conv, state = pools()
    want_conv, want_state = conv.clone(), state.clone()
    want = verify_then_next(lib, w, proj, lens, slots, want_conv, want_state, keep, accepted, nxt, nxt_lens,
                            nxt_keep, owed=False)
    got = verify_then_next(lib, w, proj, lens, slots, conv, state, keep, accepted, nxt, nxt_lens, nxt_keep,
                           owed=True)
    assert torch.equal(got, want)
    assert torch.equal(conv, want_conv) and torch.equal(state, want_state)
    assert not torch.equal(state[slots[0]], pools()[1][slots[0]])  # the step did advance them
