"""Gated DeltaNet (kernels.torch.gated_delta, kernels/cpu/src/gated_delta.c): the recurrent and chunked forms of the gated
delta rule and the ragged causal conv agree with float64 references written here token by token; a state carried
across any split of a sequence equals one pass; a ragged batch equals its sequences alone; bad batches are
refused; the native kernels match the twins for every variant this CPU runs; and the whole layer matches
transformers' Qwen3_5GatedDeltaNet, in one pass and through prefill, decode and chunked continuation."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from edgeserve.engine.cache.state_pool import StatePool, StateSpec
from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels import dispatch
from edgeserve.kernels.torch import gated_delta as gd

from support.gguf_tensors import tiled_order

CHUNKED = pytest.param("chunked", id="chunked")


def inputs(lens: list[int], hk: int = 2, hv: int = 4, dk: int = 16, dv: int = 8, slots: int | None = None,
           seed: int = 0):
    """Random q, k, v, g, beta for a ragged batch, cu_seqlens, distinct shuffled slots and random start states."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q, k = torch.randn(t, hk, dk, generator=gen), torch.randn(t, hk, dk, generator=gen)
    v = torch.randn(t, hv, dv, generator=gen)
    g = -torch.rand(t, hv, generator=gen) * 1.5  # decays from 1 down to e^-1.5
    g[::3] *= 0.01  # and some almost-1 decays: a long memory
    beta = torch.rand(t, hv, generator=gen)
    cu = torch.tensor([0] + lens).cumsum(0)
    n = slots or len(lens) + 2
    slot_ids = torch.randperm(n, generator=gen)[:len(lens)]
    state = torch.randn(n, hv, dk, dv, generator=gen) * 0.5
    return q, k, v, g, beta, cu, slot_ids, state


def reference_rule(q, k, v, g, beta, cu, slots, state, scale=None):
    """The gated delta rule in float64, sequence by sequence and token by token."""
    hv, dk = v.shape[1], q.shape[2]
    group = hv // q.shape[1]
    scale = dk ** -0.5 if scale is None else scale
    out = torch.zeros(v.shape, dtype=torch.float64)
    new = state.double().clone()
    for i in range(len(cu) - 1):
        s = new[slots[i]]  # [Hv, Dk, Dv]
        for t in range(int(cu[i]), int(cu[i + 1])):
            heads = torch.arange(hv) // group
            qt, kt = q[t, heads].double(), k[t, heads].double()  # [Hv, Dk]
            qt = qt / torch.sqrt((qt * qt).sum(-1, keepdim=True) + 1e-6) * scale
            kt = kt / torch.sqrt((kt * kt).sum(-1, keepdim=True) + 1e-6)
            s *= torch.exp(g[t].double())[:, None, None]
            delta = (v[t].double() - torch.einsum("hkv,hk->hv", s, kt)) * beta[t].double()[:, None]
            s += kt[:, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", s, qt)
    return out, new


def reference_conv(x, w, cu, slots, conv_state):
    """SiLU(causal depthwise conv) in float64 with F.conv1d, sequence by sequence; returns (out, new states)."""
    kk = w.shape[1]
    out = torch.zeros(x.shape, dtype=torch.float64)
    new = conv_state.double().clone()
    for i in range(len(cu) - 1):
        a, b = int(cu[i]), int(cu[i + 1])
        window = torch.cat([new[slots[i]], x[a:b].double()])  # [K - 1 + n, C]
        if b > a:
            out[a:b] = F.silu(F.conv1d(window.T[None], w.double()[:, None, :], groups=x.shape[1])[0].T)
        new[slots[i]] = window[window.shape[0] - (kk - 1):]
    return out, new


def B(cu, slots) -> gd.DeltaBatch:
    return gd.DeltaBatch.build(cu, slots)


def run_rule(form, q, k, v, g, beta, cu, slots, state, chunk_size=64):
    if form == "chunked":
        return gd.chunked_gated_delta_rule(q, k, v, g, beta, state, B(cu, slots), chunk_size=chunk_size)
    return gd.recurrent_gated_delta_rule(q, k, v, g, beta, state, B(cu, slots))


def close(actual, expected, tol=2e-5):
    """|actual - expected| <= tol * (|expected| + max |expected|)."""
    a, e = actual.double(), expected.double()
    assert a.shape == e.shape and torch.isfinite(a).all()
    if not e.numel():
        return
    bound = tol * (e.abs() + max(float(e.abs().max()), 1.0))
    worst = float(((a - e).abs() - bound).max())
    assert worst <= 0, f"max error {float((a - e).abs().max()):.3g} over the bound"


# --- the twins against the float64 references ------------------------------------------------------------------

@pytest.mark.parametrize("form,chunk_size", [("recurrent", 0), ("chunked", 1), ("chunked", 5), ("chunked", 16),
                                             ("chunked", 64)])
@pytest.mark.parametrize("lens,heads", [([1], (1, 1)), ([37], (2, 4)), ([64, 65, 0, 3], (2, 4)),
                                        ([130, 1, 17], (3, 3))])
def test_rule_matches_float64_reference(form, chunk_size, lens, heads):
    q, k, v, g, beta, cu, slots, state = inputs(lens, *heads)
    expected, expected_state = reference_rule(q, k, v, g, beta, cu, slots, state)
    out = run_rule(form, q, k, v, g, beta, cu, slots, state, chunk_size)
    close(out, expected)
    close(state, expected_state)


def test_rule_leaves_other_slots_alone_and_scale_is_used():
    q, k, v, g, beta, cu, slots, state = inputs([5, 9], slots=6)
    before = state.clone()
    expected, _ = reference_rule(q, k, v, g, beta, cu, slots, state, scale=0.3)
    close(gd.chunked_gated_delta_rule(q, k, v, g, beta, state, B(cu, slots), scale=0.3, chunk_size=4), expected)
    others = [i for i in range(6) if i not in slots.tolist()]
    assert torch.equal(state[others], before[others])


def test_forms_match_transformers_functions():
    """Our head grouping, L2 norm and scaling are transformers' (one sequence with an initial state)."""
    mod = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    q, k, v, g, beta, cu, slots, state = inputs([45], hk=2, hv=6)
    start = state[slots].clone()
    ref, ref_state = mod.torch_recurrent_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                          initial_state=start, output_final_state=True,
                                                          use_qk_l2norm_in_kernel=True)
    for form in ("recurrent", "chunked"):
        s = state.clone()
        close(run_rule(form, q, k, v, g, beta, cu, slots, s, chunk_size=8), ref[0])
        close(s[slots], ref_state)


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_tiled_heads_are_grouped_heads_reordered(form):
    """tiled=True on value heads stored in GGUF order gives the grouped result in that order."""
    hk, hv = 2, 6
    q, k, v, g, beta, cu, slots, state = inputs([9, 20], hk=hk, hv=hv)
    grouped_state = state.clone()
    grouped = run_rule(form, q, k, v, g, beta, cu, slots, grouped_state, chunk_size=8)
    tiled_state = tiled_order(state, 1, hk, hv // hk)
    t_v, t_g, t_b = (tiled_order(x, 1, hk, hv // hk) for x in (v, g, beta))
    if form == "chunked":
        tiled = gd.chunked_gated_delta_rule(q, k, t_v, t_g, t_b, tiled_state, B(cu, slots), chunk_size=8,
                                             tiled=True)
    else:
        tiled = gd.recurrent_gated_delta_rule(q, k, t_v, t_g, t_b, tiled_state, B(cu, slots), tiled=True)
    close(tiled, tiled_order(grouped, 1, hk, hv // hk), tol=1e-6)
    close(tiled_state, tiled_order(grouped_state, 1, hk, hv // hk), tol=1e-6)


@pytest.mark.parametrize("lens", [[1], [2], [3], [10, 0, 2, 7]])
@pytest.mark.parametrize("kernel", [4, 2, 1])
def test_conv_matches_float64_reference(lens, kernel):
    gen = torch.Generator().manual_seed(1)
    c = 24
    x = torch.randn(sum(lens), c, generator=gen)
    w = torch.randn(c, kernel, generator=gen)
    cu = torch.tensor([0] + lens).cumsum(0)
    slots = torch.randperm(len(lens) + 1, generator=gen)[:len(lens)]
    conv_state = torch.randn(len(lens) + 1, kernel - 1, c, generator=gen)
    expected, expected_state = reference_conv(x, w, cu, slots, conv_state)
    close(gd.causal_conv1d_silu(x, w, conv_state, B(cu, slots)), expected)
    close(conv_state, expected_state)


# --- chunking and batching invariance --------------------------------------------------------------------------

@pytest.mark.parametrize("form", ["recurrent", "chunked"])
@pytest.mark.parametrize("cuts", [[1], [63, 64], [5, 6, 7, 70, 99]])
def test_state_carried_across_pieces_equals_one_pass(form, cuts):
    """A 100-token sequence run in pieces, each continuing from the state the last left, gives one pass's outputs
    and final state (conv state and recurrent state both)."""
    n = 100
    q, k, v, g, beta, _, _, state = inputs([n], slots=1)
    x = torch.randn(n, 12)
    w = torch.randn(12, 4)
    one_state, one_conv = state.clone(), torch.zeros(1, 3, 12)
    whole = torch.tensor([0, n])
    slot = torch.tensor([0])
    one = run_rule(form, q, k, v, g, beta, whole, slot, one_state, chunk_size=16)
    one_x = gd.causal_conv1d_silu(x, w, one_conv, B(whole, slot))
    outs, xs = [], []
    piece_state, piece_conv = state.clone(), torch.zeros(1, 3, 12)
    for a, b in zip([0] + cuts, cuts + [n]):
        cu = torch.tensor([0, b - a])
        outs.append(run_rule(form, q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], cu, slot, piece_state,
                             chunk_size=16))
        xs.append(gd.causal_conv1d_silu(x[a:b], w, piece_conv, B(cu, slot)))
    close(torch.cat(outs), one)
    close(piece_state, one_state)
    close(torch.cat(xs), one_x, tol=1e-6)
    close(piece_conv, one_conv, tol=0)


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_ragged_batch_equals_sequences_alone(form):
    lens = [3, 0, 40, 1, 17]
    q, k, v, g, beta, cu, slots, state = inputs(lens)
    batch_state = state.clone()
    batch = run_rule(form, q, k, v, g, beta, cu, slots, batch_state, chunk_size=16)
    for i in range(len(lens)):
        a, b = int(cu[i]), int(cu[i + 1])
        alone_state = state.clone()
        alone = run_rule(form, q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], torch.tensor([0, b - a]),
                         slots[i:i + 1], alone_state, chunk_size=16)
        close(batch[a:b], alone, tol=1e-6)
        close(batch_state[slots[i]], alone_state[slots[i]], tol=1e-6)


@pytest.mark.parametrize("lens", [[0, 0], []])
def test_empty_batch_and_empty_sequences_change_nothing(lens):
    q, k, v, g, beta, cu, slots, state = inputs(lens)
    before = state.clone()
    for form in ("recurrent", "chunked"):
        assert run_rule(form, q, k, v, g, beta, cu, slots, state).shape == (0, 4, 8)
        assert torch.equal(state, before)
    if cpu_native.available():
        assert cpu_native.gdn_rule(q, k, v, g, beta, state, B(cu, slots)).shape == (0, 4, 8)
        assert torch.equal(state, before)
    conv_state = torch.randn(3, 3, 6)
    kept = conv_state.clone()
    assert gd.causal_conv1d_silu(torch.zeros(0, 6), torch.randn(6, 4), conv_state, B(cu, slots)).shape == (0, 6)
    assert torch.equal(conv_state, kept)


@pytest.mark.parametrize("cu,slots,message", [
    ([1, 5], [0], "start at 0"), ([0, 6, 5], [0, 1], "never decrease"), ([0, 2, 5], [1, 1], "share a state slot"),
    ([0, 5], [-1], "slots must lie"), ([0, 2, 5], [0], "one slot per sequence"), ([[0, 5]], [0], "1-D"),
    (torch.tensor([0.0, 5.0]), [0], "integer")])
def test_bad_batches_are_refused(cu, slots, message):
    with pytest.raises(ValueError, match=message):
        gd.DeltaBatch.build(cu, slots)


@pytest.mark.parametrize("cu,slots,message", [([0, 4], [0], "tokens"), ([0, 5], [4], "slots must lie")])
def test_batches_that_do_not_fit_are_refused(cu, slots, message):
    """A batch of another token count than the inputs, or with a slot past the pool's end."""
    q, k, v, g, beta, _, _, state = inputs([5], slots=4)
    batch = gd.DeltaBatch.build(cu, slots)
    with pytest.raises(ValueError, match="slots must lie"):
        gd.DeltaBatch.build([0, 5], [4], num_slots=4)
    for call in (lambda: gd.recurrent_gated_delta_rule(q, k, v, g, beta, state, batch),
                 lambda: gd.chunked_gated_delta_rule(q, k, v, g, beta, state, batch),
                 lambda: gd.causal_conv1d_silu(torch.zeros(5, 6), torch.ones(6, 4), torch.zeros(4, 3, 6), batch)):
        with pytest.raises(ValueError, match=message):
            call()


def test_bad_shapes_are_refused():
    q, k, v, g, beta, cu, slots, state = inputs([5])
    with pytest.raises(ValueError, match="recurrent state"):
        gd.recurrent_gated_delta_rule(q, k, v, g, beta, state[:, :, :, :4], B(cu, slots))
    with pytest.raises(ValueError, match="shapes do not fit"):
        gd.recurrent_gated_delta_rule(q, k, v[:, :3], g, beta, state, B(cu, slots))
    with pytest.raises(ValueError, match="multiple"):
        gd.DeltaNetDims(num_k_heads=2, num_v_heads=3, head_k_dim=8, head_v_dim=8)


# --- the native kernels ----------------------------------------------------------------------------------------

native = pytest.mark.skipif(not cpu_native.available(), reason="no native CPU kernels here")


@pytest.fixture(scope="module", params=cpu_native.supported_variants() if cpu_native.available() else [])
def lib(request):
    return cpu_native.load(request.param)


def pool_views(dims: gd.DeltaNetDims, num_slots: int, layer: int = 1, seed: int = 0):
    """A StatePool of 3 layers filled with random states and one layer's views (a slot stride of 3 blocks)."""
    pool = StatePool(StateSpec(3, dims), num_slots)
    gen = torch.Generator().manual_seed(seed)
    pool.conv.copy_(torch.randn(pool.conv.shape, generator=gen))
    pool.recurrent.copy_(torch.randn(pool.recurrent.shape, generator=gen) * 0.5)
    return pool, *pool.layer(layer)


@native
@pytest.mark.parametrize("lens", [[1, 1, 1], [200], [3, 0, 77, 130, 1]])
def test_native_matches_twins(lib, lens):
    """Native conv + rule against the twins on a ragged batch, reading q / k / v as strided views of the conv
    output and the states through a pool layer's strided views; other layers and slots stay untouched."""
    dims = gd.DeltaNetDims(num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=24)
    t = sum(lens)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(t, dims.conv_dim, generator=gen)
    w = torch.randn(dims.conv_dim, 4, generator=gen) * 0.5
    g = -torch.rand(t, dims.num_v_heads, generator=gen)
    beta = torch.rand(t, dims.num_v_heads, generator=gen)
    cu = torch.tensor([0] + lens).cumsum(0)
    slots = torch.randperm(len(lens) + 2, generator=gen)[:len(lens)]
    twin_pool, twin_conv, twin_state = pool_views(dims, len(lens) + 2)
    nat_pool, nat_conv, nat_state = pool_views(dims, len(lens) + 2)
    results = []
    batch = B(cu, slots)
    for conv_fn, rule_fn, conv_state, state in (
            (gd.causal_conv1d_silu, gd.recurrent_gated_delta_rule, twin_conv, twin_state),
            (lambda *a: cpu_native.gdn_conv(*a, lib=lib), lambda *a: cpu_native.gdn_rule(*a, lib=lib), nat_conv,
             nat_state)):
        y = conv_fn(x, w, conv_state, batch)
        q, k, v = y.split([dims.key_dim, dims.key_dim, dims.value_dim], dim=-1)
        q = q.reshape(t, dims.num_k_heads, dims.head_k_dim)
        k = k.reshape(t, dims.num_k_heads, dims.head_k_dim)
        v = v.reshape(t, dims.num_v_heads, dims.head_v_dim)
        results.append((y, rule_fn(q, k, v, g, beta, state, batch)))
    (y_twin, o_twin), (y_nat, o_nat) = results
    close(y_nat, y_twin, tol=1e-6)
    close(o_nat, o_twin, tol=2e-5)
    close(nat_pool.conv, twin_pool.conv, tol=0)
    close(nat_pool.recurrent, twin_pool.recurrent, tol=2e-5)
    fresh, untouched_conv, untouched_state = pool_views(dims, len(lens) + 2)
    assert torch.equal(nat_pool.conv[:, [0, 2]], fresh.conv[:, [0, 2]])  # the other layers
    assert torch.equal(nat_pool.recurrent[:, [0, 2]], fresh.recurrent[:, [0, 2]])
    others = [i for i in range(len(lens) + 2) if i not in slots.tolist()]
    assert torch.equal(nat_state[others], untouched_state[others])
    assert torch.equal(nat_conv[others], untouched_conv[others])


@native
@pytest.mark.parametrize("kernel", [1, 2, 4, 6])
def test_native_conv_matches_float64_reference(lib, kernel):
    """Every kernel width, sequences shorter than the state (their new state is part old state) and channel counts
    that are not a multiple of the kernel's channel block."""
    lens = [1, 2, 0, 9, 70]
    gen = torch.Generator().manual_seed(kernel)
    x = torch.randn(sum(lens), 100, generator=gen)
    w = torch.randn(100, kernel, generator=gen)
    cu = torch.tensor([0] + lens).cumsum(0)
    slots = torch.randperm(len(lens) + 1, generator=gen)[:len(lens)]
    conv_state = torch.randn(len(lens) + 1, kernel - 1, 100, generator=gen)
    expected, expected_state = reference_conv(x, w, cu, slots, conv_state)
    close(cpu_native.gdn_conv(x, w, conv_state, B(cu, slots), lib=lib), expected)
    close(conv_state, expected_state, tol=0)


@native
def test_native_tiled_heads_match_twin(lib):
    q, k, v, g, beta, cu, slots, state = inputs([1, 40, 3], hk=2, hv=6, dk=16, dv=40)
    twin_state, nat_state = state.clone(), state.clone()
    twin = gd.recurrent_gated_delta_rule(q, k, v, g, beta, twin_state, B(cu, slots), tiled=True)
    nat = cpu_native.gdn_rule(q, k, v, g, beta, nat_state, B(cu, slots), tiled=True, lib=lib)
    close(nat, twin)
    close(nat_state, twin_state)
    grouped = gd.recurrent_gated_delta_rule(q, k, v, g, beta, state.clone(), B(cu, slots))
    assert (grouped - twin).abs().max() > 1e-2  # the two head orders really differ on these inputs


@native
def test_native_prefill_matches_chunked_twin_and_float64(lib):
    """A long prompt token by token natively against the chunked twin and the float64 reference."""
    q, k, v, g, beta, cu, slots, state = inputs([300, 45], hk=2, hv=4, dk=32, dv=32)
    expected, expected_state = reference_rule(q, k, v, g, beta, cu, slots, state)
    twin_state, nat_state = state.clone(), state.clone()
    twin = gd.chunked_gated_delta_rule(q, k, v, g, beta, twin_state, B(cu, slots))
    nat = cpu_native.gdn_rule(q, k, v, g, beta, nat_state, B(cu, slots), lib=lib)
    close(nat, expected)
    close(nat_state, expected_state)
    close(nat, twin)


@native
def test_native_rule_full_and_partial_column_blocks(lib):
    """Value heads wider than the kernel's column block (64 on AVX-512 builds, 32 elsewhere) with a partial block
    after the full ones, against float64 and batch-invariant."""
    lens = [1, 33, 70]
    q, k, v, g, beta, cu, slots, state = inputs(lens, hk=1, hv=3, dk=48, dv=100)
    expected, expected_state = reference_rule(q, k, v, g, beta, cu, slots, state)
    nat_state = state.clone()
    nat = cpu_native.gdn_rule(q, k, v, g, beta, nat_state, B(cu, slots), lib=lib)
    close(nat, expected)
    close(nat_state, expected_state)
    a, b = int(cu[2]), int(cu[3])
    alone_state = state.clone()
    alone = cpu_native.gdn_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], alone_state,
                                B(torch.tensor([0, b - a]), slots[2:]), lib=lib)
    assert torch.equal(alone, nat[a:b]) and torch.equal(alone_state[slots[2]], nat_state[slots[2]])


@native
@pytest.mark.skipif(os.uname().machine not in ("x86_64", "i686"), reason="the flush is x86's MXCSR")
@pytest.mark.parametrize("lens", [[1], [3]])
def test_native_rule_flushes_subnormal_states_and_restores_the_thread(lib, lens):
    """A state of subnormal floats (what long decays leave; each multiply on one is a slow microcode assist) is read
    as zero by the native rule, on the decode row's path and the column blocks', and the calling thread's
    floating-point mode is left as it was (torch keeps its subnormals)."""
    q, k, v, g, beta, cu, slots, state = inputs(lens, dk=16, dv=8)
    v.zero_()  # no new memory: the outputs are the old state's, which reads as zero
    state.fill_(1e-39)
    out = cpu_native.gdn_rule(q, k, v, g, beta, state, B(cu, slots), lib=lib)
    assert torch.count_nonzero(out) == 0 and torch.count_nonzero(state[slots]) == 0
    assert torch.count_nonzero(state) == state[0].numel() * (state.shape[0] - len(lens))  # other slots untouched
    tiny = torch.tensor([1e-39]) * torch.tensor([1.0])
    assert tiny.item() != 0.0


@native
def test_native_is_batch_invariant(lib):
    """A sequence's outputs and states from the native kernels are the same bits alone as in a ragged batch."""
    lens = [7, 1, 0, 50]
    q, k, v, g, beta, cu, slots, state = inputs(lens, dk=32, dv=40)
    x, w = torch.randn(sum(lens), 24), torch.randn(24, 4)
    conv_state = torch.randn(state.shape[0], 3, 24)
    s, cs = state.clone(), conv_state.clone()
    batch_o = cpu_native.gdn_rule(q, k, v, g, beta, s, B(cu, slots), lib=lib)
    batch_x = cpu_native.gdn_conv(x, w, cs, B(cu, slots), lib=lib)
    for i in range(len(lens)):
        a, b, one = int(cu[i]), int(cu[i + 1]), torch.tensor([0, lens[i]])
        s1, cs1 = state.clone(), conv_state.clone()
        alone = B(one, slots[i:i + 1])
        assert torch.equal(cpu_native.gdn_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s1, alone, lib=lib),
                           batch_o[a:b])
        assert torch.equal(cpu_native.gdn_conv(x[a:b], w, cs1, alone, lib=lib), batch_x[a:b])
        assert torch.equal(s1[slots[i]], s[slots[i]]) and torch.equal(cs1[slots[i]], cs[slots[i]])


@native
def test_native_refuses_bad_batches(lib):
    q, k, v, g, beta, cu, slots, state = inputs([5], slots=2)
    with pytest.raises(ValueError, match="slots must lie"):
        cpu_native.gdn_rule(q, k, v, g, beta, state, B(cu, [2]), lib=lib)
    with pytest.raises(ValueError, match="slots must lie"):
        cpu_native.gdn_conv(torch.zeros(5, 6), torch.ones(6, 4), torch.zeros(2, 3, 6), B(cu, [2]), lib=lib)
    with pytest.raises(ValueError, match="tokens"):
        cpu_native.gdn_rule(q[:4], k[:4], v[:4], g[:4], beta[:4], state, B(cu, slots), lib=lib)


@native
def test_native_declines_what_it_does_not_take(lib):
    q, k, v, g, beta, cu, slots, state = inputs([5])
    assert cpu_native.gdn_rule(q.double(), k, v, g, beta, state, B(cu, slots), lib=lib) is None
    assert cpu_native.gdn_rule(q, k, v, g, beta, state.double(), B(cu, slots), lib=lib) is None
    assert cpu_native.gdn_conv(torch.zeros(5, 6), torch.ones(6, 17), torch.zeros(7, 16, 6), B(cu, slots),
                               lib=lib) is None


@native
def test_dispatch_takes_native_kernels_unless_torch_is_forced():
    q, k, v, g, beta, cu, slots, state = inputs([30, 2], dk=32, dv=32)
    x, w, conv_state = torch.randn(32, 20), torch.randn(20, 4), torch.randn(4, 3, 20)
    results = {}
    for name, backend in (("native", "auto"), ("twin", "torch")):
        s, cs = state.clone(), conv_state.clone()
        with dispatch.force_backend(backend):
            results[name] = (dispatch.gated_delta_rule(q, k, v, g, beta, s, B(cu, slots)),
                             dispatch.causal_conv1d_silu(x, w, cs, B(cu, slots)))
    s, cs = state.clone(), conv_state.clone()
    assert torch.equal(results["native"][0], cpu_native.gdn_rule(q, k, v, g, beta, s, B(cu, slots)))
    assert torch.equal(results["native"][1], cpu_native.gdn_conv(x, w, cs, B(cu, slots)))
    s, cs = state.clone(), conv_state.clone()
    assert torch.equal(results["twin"][0], gd.gated_delta_rule(q, k, v, g, beta, s, B(cu, slots)))
    assert torch.equal(results["twin"][1], gd.causal_conv1d_silu(x, w, cs, B(cu, slots)))


def head_views(t: int, h: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x, z [t, h, d]: strided views of wider rows (a token stride of h * 2 * d + 3, a head stride of 2 * d), as the
    model reads them out of a fused projection's output."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(t, h * 2 * d + 3, generator=gen) * 2
    heads = rows[:, 3:].view(t, h, 2 * d)
    return heads[:, :, :d], heads[:, :, d:]


def reference_head_norm(x, w, eps, z=None):
    x64 = x.double()
    out = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    return out if z is None else out * F.silu(z.double())


@native
@pytest.mark.parametrize("t,h,d", [(1, 1, 8), (7, 3, 24), (37, 5, 100), (64, 16, 128)])
def test_native_head_norms_match_float64(lib, t, h, d):
    """The per-head RMSNorm and the gated RMSNorm read strided head views in place and match float64, with odd
    token and head counts and head sizes that are not a multiple of the kernel's 16 lanes."""
    x, z = head_views(t, h, d, seed=t)
    w = torch.randn(d, generator=torch.Generator().manual_seed(1))
    close(cpu_native.head_rms_norm(x, w, 1e-6, lib=lib), reference_head_norm(x, w, 1e-6))
    close(cpu_native.head_rms_norm(x, w, 1e-6, z, lib=lib), reference_head_norm(x, w, 1e-6, z))
    close(gd.gated_rms_norm(x, z, w, 1e-6), reference_head_norm(x, w, 1e-6, z))


@native
@pytest.mark.parametrize("t,h,d", [(1, 1, 8), (7, 3, 24), (37, 5, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_sigmoid_gate_matches_float64(lib, t, h, d, dtype):
    o, gate = head_views(t, h, d, seed=t + 1)
    o = o.contiguous().to(dtype)
    expected = o.double() * torch.sigmoid(gate.double())
    close(cpu_native.sigmoid_gate(o, gate, lib=lib), expected)
    close(dispatch._act.sigmoid_gate(o, gate), expected)


@native
@pytest.mark.parametrize("t,h,d", [(1, 1, 8), (7, 3, 24), (37, 5, 100), (9, 16, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_per_head_sigmoid_gate_matches_the_twin(lib, t, h, d, dtype):
    """One gate per head (LFM3's: the last h values of a projection's rows, expanded over the head's d values with
    stride 0) scales every value of its head, as the torch twin and float64 do; the other heads' gates stay theirs."""
    gen = torch.Generator().manual_seed(t + h)
    o = (torch.randn(t, h, d, generator=gen) * 2).to(dtype)
    rows = torch.randn(t, 3 * h + 5, generator=gen) * 3
    gate = rows[:, -h:, None].expand(t, h, d)
    assert gate.stride(2) == 0
    got = cpu_native.sigmoid_gate(o, gate, lib=lib)
    close(got, o.double() * torch.sigmoid(rows[:, -h:].double())[:, :, None])
    close(got, dispatch._act.sigmoid_gate(o, gate))
    assert torch.equal(got, cpu_native.sigmoid_gate(o, gate.contiguous(), lib=lib))  # the values' own gates alike


@native
def test_native_head_kernels_are_batch_invariant(lib):
    """A token's rows from the norm / gate kernels are the same bits alone as among 37 tokens."""
    x, z = head_views(37, 5, 100, seed=3)
    w = torch.randn(100)
    many = (cpu_native.head_rms_norm(x, w, 1e-6, z, lib=lib), cpu_native.head_rms_norm(x, w, 1e-6, lib=lib),
            cpu_native.sigmoid_gate(x.contiguous(), z, lib=lib))
    for i in (0, 17, 36):
        one = (cpu_native.head_rms_norm(x[i:i + 1], w, 1e-6, z[i:i + 1], lib=lib),
               cpu_native.head_rms_norm(x[i:i + 1], w, 1e-6, lib=lib),
               cpu_native.sigmoid_gate(x[i:i + 1].contiguous(), z[i:i + 1], lib=lib))
        for a, b in zip(one, many):
            assert torch.equal(a[0], b[i])


@native
def test_native_head_kernels_decline_what_they_do_not_take(lib):
    x, z = head_views(3, 2, 16, seed=0)
    w = torch.ones(16)
    assert cpu_native.head_rms_norm(x.double(), w, 1e-6, lib=lib) is None
    assert cpu_native.head_rms_norm(x, torch.ones(8), 1e-6, lib=lib) is None  # weight of another size
    assert cpu_native.head_rms_norm(x, w, 1e-6, z[:2], lib=lib) is None
    assert cpu_native.sigmoid_gate(x, z, lib=lib) is None  # o must be contiguous
    assert cpu_native.head_rms_norm(*head_views(2, 1, 600, seed=0)[:1], torch.ones(600), 1e-6, lib=lib) is None


@native
def test_dispatch_takes_native_head_kernels_unless_torch_is_forced():
    x, z = head_views(9, 3, 40, seed=5)
    w = torch.randn(40)
    o = x.contiguous()
    native = (dispatch.gated_rms_norm(x, z, w, 1e-6), dispatch.head_rms_norm(x, w, 1e-6), dispatch.sigmoid_gate(o, z))
    assert torch.equal(native[0], cpu_native.head_rms_norm(x, w, 1e-6, z))
    assert torch.equal(native[1], cpu_native.head_rms_norm(x, w, 1e-6))
    assert torch.equal(native[2], cpu_native.sigmoid_gate(o, z))
    with dispatch.force_backend("torch"):
        twin = (dispatch.gated_rms_norm(x, z, w, 1e-6), dispatch.head_rms_norm(x, w, 1e-6),
                dispatch.sigmoid_gate(o, z))
    assert torch.equal(twin[0], gd.gated_rms_norm(x, z, w, 1e-6))
    assert torch.equal(twin[2], dispatch._act.sigmoid_gate(o, z))
    for a, b in zip(native, twin):
        close(a, b)


@native
@pytest.mark.parametrize("t,hv", [(1, 4), (37, 16)])
def test_native_gates_match_float64(lib, t, hv):
    """The decay and write gates from a, b read as strided columns of one projection, against float64, with inputs
    past softplus's linear threshold (20) among them; a token's gates are the same bits alone as among others; the
    dispatch takes them natively (the per-op layer and the fused stack share them), the twin when torch is forced."""
    gen = torch.Generator().manual_seed(t)
    proj = torch.randn(t, 3 * hv, generator=gen) * 8
    proj[0, 2 * hv] = 25.0  # softplus(x) is x here
    b, a = proj[:, hv:2 * hv], proj[:, 2 * hv:]
    A_log, dt_bias = torch.randn(hv, generator=gen), torch.randn(hv, generator=gen)
    g, beta = cpu_native.gdn_gates(a, b, A_log, dt_bias, lib=lib)
    close(g, -A_log.double().exp() * F.softplus(a.double() + dt_bias.double()))
    close(beta, torch.sigmoid(b.double()))
    one = cpu_native.gdn_gates(a[-1:], b[-1:], A_log, dt_bias, lib=lib)
    assert torch.equal(one[0][0], g[-1]) and torch.equal(one[1][0], beta[-1])
    assert cpu_native.gdn_gates(a.double(), b, A_log, dt_bias, lib=lib) is None
    assert all(torch.equal(x, y) for x, y in zip(dispatch.delta_gates(a, b, A_log, dt_bias),
                                                 cpu_native.gdn_gates(a, b, A_log, dt_bias)))
    with dispatch.force_backend("torch"):
        twin = dispatch.delta_gates(a, b, A_log, dt_bias)
    assert all(torch.equal(x, y) for x, y in zip(twin, gd.delta_gates(a, b, A_log, dt_bias)))


# --- the whole layer against transformers --------------------------------------------------------------------

def hf_layer(hk=2, hv=4, dk=8, dv=16, hidden=32, seed=0):
    """transformers' Qwen3_5GatedDeltaNet (tiny, float32, random weights) and our dims and weights for it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    mod = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(hidden_size=hidden, linear_num_key_heads=hk, linear_num_value_heads=hv,
                            linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel_dim=4,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                            vocab_size=16, layer_types=["linear_attention", "full_attention"])
    torch.manual_seed(seed)
    layer = mod.Qwen3_5GatedDeltaNet(cfg, 0).float().eval()
    with torch.no_grad():
        for p in (layer.dt_bias, layer.norm.weight):
            p.copy_(torch.randn(p.shape) * 0.5 + 1)
    dims = gd.DeltaNetDims(hk, hv, dk, dv, 4)
    weights = gd.DeltaNetWeights(layer.conv1d.weight.detach()[:, 0], layer.A_log.detach(), layer.dt_bias.detach(),
                                 layer.norm.weight.detach(), cfg.rms_norm_eps)
    return cfg, layer, dims, weights


def our_layer(layer, dims, weights, h, cu, pool, slots, net):
    """Our layer with transformers' projections around it: h [T, hidden] -> [T, hidden]."""
    conv_state, state = pool.layer(0)
    with torch.no_grad():
        mixed = net(layer.in_proj_qkv(h), layer.in_proj_z(h), layer.in_proj_a(h), layer.in_proj_b(h), weights, dims,
                    conv_state, state, B(cu, slots))
        return layer.out_proj(mixed)


NETS = [pytest.param(gd.gated_delta_net, id="twins"), pytest.param(dispatch.gated_delta_net, id="dispatch")]


@pytest.mark.parametrize("net", NETS)
def test_layer_matches_transformers_one_pass_ragged(net):
    """Two prompts of different lengths in one flat batch against transformers' layer on each alone."""
    cfg, layer, dims, weights = hf_layer()
    lens = [70, 9]
    h = torch.randn(sum(lens), cfg.hidden_size)
    cu = torch.tensor([0] + lens).cumsum(0)
    pool = StatePool(StateSpec(1, dims), 4)
    slots = torch.tensor([pool.allocate() for _ in lens][::-1])
    ours = our_layer(layer, dims, weights, h, cu, pool, slots, net)
    with torch.no_grad():
        for i in range(len(lens)):
            a, b = int(cu[i]), int(cu[i + 1])
            close(ours[a:b], layer(h[None, a:b])[0], tol=1e-5)


@pytest.mark.parametrize("net", NETS)
def test_layer_matches_transformers_through_prefill_decode_and_chunks(net):
    """transformers' layer with its cache (prefill 11, decode 1, decode 1, a chunk of 7) against ours with a slot;
    a second sequence in the same batches (another slot) keeps ours honest about slots."""
    from transformers import DynamicCache

    cfg, layer, dims, weights = hf_layer(hk=2, hv=2, dk=16, dv=8, seed=3)
    pool = StatePool(StateSpec(1, dims), 3)
    slot_a, slot_b = pool.allocate(), pool.allocate()
    cache_a, cache_b = DynamicCache(config=cfg), DynamicCache(config=cfg)
    gen = torch.Generator().manual_seed(4)
    for n_a, n_b in [(11, 5), (1, 1), (1, 6), (7, 1)]:
        h_a, h_b = torch.randn(n_a, cfg.hidden_size, generator=gen), torch.randn(n_b, cfg.hidden_size, generator=gen)
        ours = our_layer(layer, dims, weights, torch.cat([h_a, h_b]), torch.tensor([0, n_a, n_a + n_b]), pool,
                         torch.tensor([slot_a, slot_b]), net)
        with torch.no_grad():
            close(ours[:n_a], layer(h_a[None], cache=cache_a)[0], tol=1e-5)
            close(ours[n_a:], layer(h_b[None], cache=cache_b)[0], tol=1e-5)


def test_gated_rms_norm_matches_transformers():
    mod = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    norm = mod.Qwen3_5RMSNormGated(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
        o, z = torch.randn(10, 16), torch.randn(10, 16)
        close(gd.gated_rms_norm(o, z, norm.weight, 1e-6), norm(o, z), tol=1e-6)


@pytest.mark.parametrize("net", NETS)
def test_layer_with_gguf_head_order_matches_transformers(net):
    """transformers' weights moved to llama.cpp's tiled value-head order (the qwen35 GGUF layout: v rows of
    in_proj_qkv and the conv, in_proj_z / a / b rows, A_log, dt_bias, out_proj's columns) run with tiled=True give
    transformers' output."""
    cfg, layer, dims, weights = hf_layer(hk=2, hv=6, dk=8, dv=8, hidden=24, seed=5)
    hk, r, dv, kd = dims.num_k_heads, dims.num_v_heads // dims.num_k_heads, dims.head_v_dim, dims.key_dim
    with torch.no_grad():
        qkv_w = layer.in_proj_qkv.weight.clone()
        qkv_w[2 * kd:] = tiled_order(qkv_w[2 * kd:], 0, hk, r, dv)
        conv_w = weights.conv_weight.clone()
        conv_w[2 * kd:] = tiled_order(conv_w[2 * kd:], 0, hk, r, dv)
        z_w = tiled_order(layer.in_proj_z.weight, 0, hk, r, dv)
        a_w, b_w = tiled_order(layer.in_proj_a.weight, 0, hk, r), tiled_order(layer.in_proj_b.weight, 0, hk, r)
        out_w = tiled_order(layer.out_proj.weight, 1, hk, r, dv)
    tiled_dims = gd.DeltaNetDims(dims.num_k_heads, dims.num_v_heads, dims.head_k_dim, dv, 4, tiled=True)
    tiled_weights = gd.DeltaNetWeights(conv_w, tiled_order(weights.A_log, 0, hk, r),
                                       tiled_order(weights.dt_bias, 0, hk, r), weights.norm_weight, weights.norm_eps)
    h = torch.randn(13, cfg.hidden_size)
    pool = StatePool(StateSpec(1, tiled_dims), 1)
    conv_state, state = pool.layer(0)
    slots = torch.tensor([pool.allocate()])
    with torch.no_grad():
        mixed = net(h @ qkv_w.T, h @ z_w.T, h @ a_w.T, h @ b_w.T, tiled_weights, tiled_dims, conv_state, state,
                    B([0, 13], slots))
        close(mixed @ out_w.T, layer(h[None])[0], tol=1e-5)


# --- the state after every row (speculative verification) ------------------------------------------------------

@native
@pytest.mark.parametrize("lens", [[3], [1, 4, 2]])
def test_native_row_states_restore_equals_recompute(lib, lens):
    """gdn_rule_rows (kernels/cpu/src/gated_delta_rows.c) over k + 1 verified rows per sequence: the state it keeps
    after row j is, bit for bit, the one computing rows 0..j again from the step's start state gives (a partly
    accepted run of drafts restores it instead), its outputs and final states are gdn_rule's over the whole batch,
    and its row states match the torch twin's (gated_delta_rule_rows)."""
    q, k, v, g, beta, cu, slots, start = inputs(lens, dk=32, dv=24, seed=5)
    state = start.clone()
    out, rows = cpu_native.gdn_rule_rows(q, k, v, g, beta, state, B(cu, slots), lib=lib)
    whole = start.clone()
    assert torch.equal(out, cpu_native.gdn_rule(q, k, v, g, beta, whole, B(cu, slots), lib=lib))
    assert torch.equal(state, whole)
    for b, slot in enumerate(slots.tolist()):
        for j in range(lens[b]):
            a, e = int(cu[b]), int(cu[b]) + j + 1
            again = start.clone()
            cpu_native.gdn_rule(q[a:e], k[a:e], v[a:e], g[a:e], beta[a:e], again, B([0, e - a], [slot]), lib=lib)
            assert torch.equal(rows[e - 1], again[slot]), (b, j)
    twin_state = start.clone()
    twin_out, twin_rows = gd.gated_delta_rule_rows(q, k, v, g, beta, twin_state, B(cu, slots))
    assert torch.allclose(rows, twin_rows, atol=1e-5) and torch.allclose(out, twin_out, atol=1e-5)
    assert not torch.allclose(rows[0], rows[1], atol=1e-3)  # the rows' states differ: a lag of one row would show


def test_twin_row_states_are_the_float64_reference_after_each_row():
    """gated_delta_rule_rows' state after row j of a sequence is reference_rule's over rows 0..j."""
    lens = [2, 3]
    q, k, v, g, beta, cu, slots, start = inputs(lens, seed=6)
    out, rows = gd.gated_delta_rule_rows(q, k, v, g, beta, start.clone(), B(cu, slots))
    ref_out, _ = reference_rule(q, k, v, g, beta, cu, slots, start)
    assert torch.allclose(out.double(), ref_out, atol=1e-5)
    for b, slot in enumerate(slots.tolist()):
        for j in range(lens[b]):
            a, e = int(cu[b]), int(cu[b]) + j + 1
            _, ref = reference_rule(q[a:e], k[a:e], v[a:e], g[a:e], beta[a:e], torch.tensor([0, e - a]),
                                    [slot], start)
            assert torch.allclose(rows[e - 1].double(), ref[slot], atol=1e-5), (b, j)
