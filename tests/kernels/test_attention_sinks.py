"""Attention sinks (gpt-oss): a learned logit per head added to that head's softmax denominator, with no value.
Every attention path (the torch twin, the native CPU kernel's entry points and row layouts, the Triton decode and
prefill kernels in the interpreter, the contiguous cache) against a float64 reference, with and without a sliding
window, over odd lengths, block boundaries and key-segment boundaries."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICES, assert_close, kernel_device, paged_batch

from edgeserve.kernels.cpu import native as cpu_native

from edgeserve.kernels import dispatch
from edgeserve.kernels.torch.paged_attention import AttentionMetadata
from edgeserve.kernels.torch.paged_attention import paged_attention as twin
from edgeserve.models.attention import causal_attention

# (query_lens, seq_lens, block_size): decodes, a fresh prompt and a chunk after a cached prefix, a block-boundary
# end, a mixed step; odd lengths throughout
MIXES = {
    "decode": ([1, 1, 1, 1], [5, 16, 33, 1], 4),
    "prefill": ([7, 20], [7, 37], 8),
    "boundary": ([16, 3], [32, 3], 16),
    "mixed": ([1, 9, 1, 4], [16, 9, 2, 21], 16),
}


def sinks_for(heads: int, seed: int = 7) -> torch.Tensor:
    """Sinks large enough to take a visible share of each softmax (scores here are about +-3)."""
    return torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2 + 1


def reference(q, k_cache, v_cache, meta: AttentionMetadata, sinks, window: int | None = None,
              scale: float | None = None) -> torch.Tensor:
    """The attention row by row in float64: softmax over [visible scores, sink], the sink's weight dropped."""
    t, h, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    scale = d ** -0.5 if scale is None else scale
    out = torch.zeros(t, h, d, dtype=torch.float64)
    row = 0
    for i, (n, s) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        table = meta.block_tables[i].cpu().long()
        for j in range(n):
            end = s - n + j + 1
            keys = torch.arange(0 if window is None else max(0, end - window), end)
            where = table[keys // bs] * bs + keys % bs
            kk = k_cache.cpu().flatten(0, 1)[where].double().repeat_interleave(h // hkv, dim=1)  # [n, H, D]
            vv = v_cache.cpu().flatten(0, 1)[where].double().repeat_interleave(h // hkv, dim=1)
            scores = torch.einsum("hd,nhd->hn", q[row].cpu().double(), kk) * scale
            w = torch.softmax(torch.cat([scores, sinks.double()[:, None]], dim=1), dim=1)[:, :-1]
            out[row] = torch.einsum("hn,nhd->hd", w, vv)
            row += 1
    return out


def case(mix: str, heads: int, heads_kv: int, d: int, dtype=torch.float32, device: str = "cpu", seed: int = 0):
    query_lens, seq_lens, block_size = MIXES[mix]
    k, v, meta = paged_batch(query_lens, seq_lens, block_size, heads_kv, d, dtype, device, seed)
    q = torch.randn(sum(query_lens), heads, d, generator=torch.Generator().manual_seed(seed + 1)).to(dtype).to(device)
    return q, k, v, meta


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("mix", list(MIXES))
def test_torch_twin_matches_float64_reference(mix, window):
    q, k, v, meta = case(mix, 6, 2, 32)
    sinks = sinks_for(6)
    got = twin(q, k, v, meta, window=window, sinks=sinks)
    expected = reference(q, k, v, meta, sinks, window)
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)
    # the sinks matter: without them the rows differ
    assert (twin(q, k, v, meta, window=window).double() - expected).abs().max() > 1e-2


def test_twin_matches_transformers_gpt_oss_eager_attention():
    """The contiguous cache's attention with sinks is transformers' gpt-oss eager attention (causal mask)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    g = torch.Generator().manual_seed(3)
    t, h, hkv, d = 9, 4, 2, 16
    q, k, v = (torch.randn(t, n, d, generator=g, dtype=torch.float64) for n in (h, hkv, hkv))
    sinks = sinks_for(h).double()
    module = torch.nn.Module()
    module.num_key_value_groups, module.sinks, module.training = h // hkv, sinks, False
    mask = torch.full((t, t), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    expected, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          v.transpose(0, 1)[None], mask, d ** -0.5)
    got = causal_attention(q, k, v, past=0, sinks=sinks)
    torch.testing.assert_close(got, expected[0].reshape(t, -1))


# ---- the native CPU kernel -------------------------------------------------------------------------------------

native = pytest.mark.skipif(not cpu_native.available(), reason="no native CPU kernels here")


@pytest.fixture(scope="module", params=cpu_native.supported_variants())
def lib(request):
    return cpu_native.load(request.param)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32)


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("mix", list(MIXES))
def test_native_matches_float64_reference(lib, mix, window, dtype):
    """Blocked prompt rows, the decode row path and the per-row path (head size 30) with sinks."""
    for heads, heads_kv, d in ((6, 2, 32), (9, 3, 64), (6, 2, 30)):
        q, k, v, meta = case(mix, heads, heads_kv, d, dtype)
        sinks = sinks_for(heads)
        got = cpu_native.paged_attention(q, k, v, meta, None, lib=lib, window=window, sinks=sinks)
        tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
        torch.testing.assert_close(got.double(), reference(q, k, v, meta, sinks, window), rtol=tol, atol=tol)


@native
@pytest.mark.parametrize("window", [None, 600])
def test_native_deep_rows_over_several_key_segments(lib, window):
    """Rows past 512 keys split into key segments (the combine path), a lone decode row at depth (one task per
    segment), and a prompt chunk crossing the segment edge; each row's bits are its bits alone."""
    heads, heads_kv, d = 8, 2, 32
    query_lens, seq_lens = [1, 6, 1], [1300, 515, 700]
    k, v, meta = paged_batch(query_lens, seq_lens, 16, heads_kv, d, torch.float32, "cpu", 5)
    q = torch.randn(sum(query_lens), heads, d, generator=torch.Generator().manual_seed(6))
    sinks = sinks_for(heads)
    got = cpu_native.paged_attention(q, k, v, meta, None, lib=lib, window=window, sinks=sinks)
    torch.testing.assert_close(got.double(), reference(q, k, v, meta, sinks, window), rtol=2e-5, atol=2e-5)
    alone = AttentionMetadata.build([1], [1300], [meta.block_tables[0].tolist()], [0])
    first = cpu_native.paged_attention(q[:1], k, v, alone, None, lib=lib, window=window, sinks=sinks)
    assert torch.equal(bits(first), bits(got[:1]))


@native
@pytest.mark.parametrize("window", [None, 5])
def test_native_sinks_of_minus_infinity_give_the_bits_of_no_sinks(lib, window):
    """A sink of -inf adds nothing to any denominator: the no-sink arithmetic, bit for bit."""
    q, k, v, meta = case("mixed", 9, 3, 64, torch.bfloat16)
    plain = cpu_native.paged_attention(q, k, v, meta, None, lib=lib, window=window)
    none = cpu_native.paged_attention(q, k, v, meta, None, lib=lib, window=window,
                                      sinks=torch.full((9,), float("-inf")))
    assert torch.equal(bits(plain), bits(none))


@native
def test_native_rows_are_batch_invariant_with_sinks(lib):
    q, k, v, meta = case("mixed", 6, 2, 32, torch.bfloat16)
    sinks = sinks_for(6)
    got = cpu_native.paged_attention(q, k, v, meta, None, lib=lib, window=5, sinks=sinks)
    # the third sequence's decode row (row 10) alone
    alone = AttentionMetadata.build([1], [2], [meta.block_tables[2].tolist()], [0])
    one = cpu_native.paged_attention(q[10:11], k, v, alone, None, lib=lib, window=5, sinks=sinks)
    assert torch.equal(bits(one), bits(got[10:11]))


def test_dispatch_routes_sinks_through_every_cpu_path():
    q, k, v, meta = case("mixed", 6, 2, 32)
    sinks = sinks_for(6)
    expected = reference(q, k, v, meta, sinks, 5)
    for name in ("auto", "torch"):
        with dispatch.force_backend(name):
            got = dispatch.paged_attention(q, k, v, meta, window=5, sinks=sinks)
        torch.testing.assert_close(got.double(), expected, rtol=2e-5, atol=2e-5)


# ---- Triton (the interpreter on CPU) ---------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("mix", list(MIXES))
def test_triton_matches_float64_reference(device, mix, window):
    device = kernel_device(device)
    q, k, v, meta = case(mix, 6, 2, 64, device=device)
    sinks = sinks_for(6).to(device)
    with dispatch.force_backend("triton"):
        got = dispatch.paged_attention(q, k, v, meta, window=window, sinks=sinks)
    assert_close(got, reference(q, k, v, meta, sinks.cpu(), window).float(), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens_per_split", [16, 256])
def test_triton_decode_splits_count_the_sink_once(device, tokens_per_split):

    device = kernel_device(device)
    # after the skip: a Triton kernel module needs triton to import
    from edgeserve.kernels.triton.decode_attention import paged_decode_attention
    q, k, v, meta = case("decode", 8, 1, 64, device=device)
    sinks = sinks_for(8).to(device)
    got = paged_decode_attention(q, k, v, meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.max_seq_len,
                                 tokens_per_split=tokens_per_split, sinks=sinks)
    assert_close(got, reference(q, k, v, meta, sinks.cpu()).float(), torch.float32)
