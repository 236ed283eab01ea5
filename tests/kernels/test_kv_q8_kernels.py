"""The q8_0 KV cache kernels (kernels/cpu/include/kv_q8.h, attention_q8.c) in every native variant: the K/V write gives
ggml's q8_0 bytes (kernels.formats.kv_quant is the reference), attention over q8_0 pools matches a float64 reference on
random K/V with odd lengths and block boundaries (plain, sliding window, sinks, split across key segments), and a
row's bits do not depend on the batch or the chunking."""

from __future__ import annotations

import pytest
import torch

from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.formats.kv_quant import dequantize_q8, q8_row_bytes, quantize_q8

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no native CPU kernels here")
BLOCK = 16


@pytest.fixture(scope="module", params=cpu_native.supported_variants())
def lib(request):
    return cpu_native.load(request.param)


def test_torch_q8_0_matches_ggml_rules():
    x = torch.tensor([[0.0] * 32, [1.0, -2.0, 0.5] + [0.0] * 29])
    q = quantize_q8(x)
    assert q.shape == (2, 34)
    assert torch.equal(q[0], torch.zeros(34, dtype=torch.uint8))  # an all-zero block: scale 0, values 0
    d = q[1, :2].view(torch.float16).float().item()
    assert d == pytest.approx(2.0 / 127, rel=1e-3)
    assert q[1, 2:5].view(torch.int8).tolist() == [64, -127, 32]  # 63.5 rounds away from zero
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_row_bytes(72)


def write(lib, k: torch.Tensor, v: torch.Tensor, blocks: int):
    """k, v [T, Hkv, D] written through the native RoPE + K/V write with an identity rotation into q8_0 pools of
    `blocks` blocks at slots 0..T-1; returns (k_pool, v_pool)."""
    t, hkv, d = k.shape
    kp = torch.zeros(blocks, BLOCK, hkv, q8_row_bytes(d), dtype=torch.uint8)
    vp = torch.zeros_like(kp)
    q = torch.randn(t, 2 * hkv, d)
    cos, sin = torch.ones(t, d // 2), torch.zeros(t, d // 2)
    slots = torch.arange(t, dtype=torch.int64)
    out = torch.empty_like(q)
    lib.qmm_rope_write_kv_fmt(q.data_ptr(), k.data_ptr(), v.data_ptr(), 0, q.stride(0), k.stride(0), v.stride(0),
                              cos.data_ptr(), sin.data_ptr(), kp.data_ptr(), vp.data_ptr(), 2, slots.data_ptr(), t,
                              q.shape[1], hkv, d, out.data_ptr(), 0)
    assert torch.equal(out, q)  # the identity rotation
    return kp, vp


@pytest.mark.parametrize("d", [32, 64, 256])
def test_native_write_gives_the_reference_bytes(lib, d):
    g = torch.Generator().manual_seed(d)
    k = torch.randn(37, 2, d, generator=g) * 3
    v = torch.randn(37, 2, d, generator=g)
    k[5, 1, :32] = 0.0  # an all-zero block
    kp, vp = write(lib, k, v, blocks=3)
    flat_k, flat_v = kp.view(-1, 2, kp.shape[-1])[:37], vp.view(-1, 2, vp.shape[-1])[:37]
    assert torch.equal(flat_k, quantize_q8(k))
    assert torch.equal(flat_v, quantize_q8(v))
    # the round trip is within half a step of each block's scale, plus the scale's float16 rounding (127 * 2^-11)
    step = flat_k.view(37, 2, d // 32, 34)[..., :2].contiguous().view(torch.float16).float()
    err = (dequantize_q8(flat_k) - k).abs().view(37, 2, d // 32, 32).amax(-1)
    assert (err <= step.squeeze(-1) * (0.5 + 127 / 2048) + 1e-6).all()


def attend_q8(lib, q, kp, vp, tables, rows, lo=None, sinks=None, scale=None):
    """q [T, H, D] over q8_0 pools; rows[t] = (sequence, keys seen); lo: first key of each row (a window)."""
    t, h, d = q.shape
    seq = torch.tensor([s for s, _ in rows], dtype=torch.int32)
    lens = torch.tensor([n for _, n in rows], dtype=torch.int32)
    lo_t = None if lo is None else torch.tensor(lo, dtype=torch.int32)
    out = torch.empty_like(q)
    rc = lib.qmm_paged_attention_q8(q.data_ptr(), q.dtype == torch.bfloat16, t, h, d, kp.data_ptr(), vp.data_ptr(),
                                    BLOCK, kp.shape[2], tables.data_ptr(), tables.stride(0), seq.data_ptr(),
                                    None if lo_t is None else lo_t.data_ptr(), lens.data_ptr(),
                                    None if sinks is None else sinks.data_ptr(),
                                    d ** -0.5 if scale is None else scale, out.data_ptr())
    assert rc == 0
    return out


def rounded_queries(q: torch.Tensor) -> torch.Tensor:
    """q [..., D] rounded as the kernel quantizes queries (qmm_quantize: q8_0 values, float32 scales), float64."""
    blocks = q.reshape(*q.shape[:-1], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(blocks * inv) * d).double().reshape(q.shape)


def reference(q, kp, vp, tables, rows, lo=None, sinks=None):
    """float64 attention of the q8_0-rounded queries over the dequantized K/V, row by row."""
    _, h, d = q.shape
    hkv = kp.shape[2]
    qq = rounded_queries(q.float())
    kf, vf = dequantize_q8(kp).double().flatten(0, 1), dequantize_q8(vp).double().flatten(0, 1)
    out = torch.zeros(q.shape, dtype=torch.float64)
    for t, (s, n) in enumerate(rows):
        first = 0 if lo is None else lo[t]
        keys = torch.arange(first, first + n)
        where = tables[s][keys // BLOCK].long() * BLOCK + keys % BLOCK
        kk = kf[where].repeat_interleave(h // hkv, dim=1)
        vv = vf[where].repeat_interleave(h // hkv, dim=1)
        scores = torch.einsum("hd,nhd->hn", qq[t], kk) * d ** -0.5
        if sinks is not None:
            scores = torch.cat([scores, sinks.double().view(h, 1)], dim=1)
        w = torch.softmax(scores, dim=-1)[:, :n]
        out[t] = torch.einsum("hn,nhd->hd", w, vv)
    return out


def random_pools(hkv, d, blocks, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (quantize_q8(torch.randn(blocks, BLOCK, hkv, d, generator=g) * 2),
            quantize_q8(torch.randn(blocks, BLOCK, hkv, d, generator=g)))


LAYOUTS = [(9, 3, 64), (4, 1, 256), (8, 8, 32), (16, 2, 128)]


@pytest.mark.parametrize("heads,hkv,d", LAYOUTS)
def test_attention_matches_float64_reference_and_rows_alone(lib, heads, hkv, d):
    kp, vp = random_pools(hkv, d, blocks=160)
    tables = torch.randperm(160, generator=torch.Generator().manual_seed(1)).view(2, 80).to(torch.int32)
    # a decode row past two key segments, an odd chunk across block boundaries, a fresh 3-row prompt, a 1-key row
    rows = [(0, 1100)] + [(1, n) for n in range(497, 530)] + [(0, n) for n in (1, 2, 3)] + [(1, 17)]
    g = torch.Generator().manual_seed(2)
    q = torch.randn(len(rows), heads, d, generator=g)
    got = attend_q8(lib, q, kp, vp, tables, rows)
    torch.testing.assert_close(got.double(), reference(q, kp, vp, tables, rows), rtol=2e-4, atol=2e-4)
    # the bits of each row do not depend on the rest of the batch or on how the chunk was cut
    for t in (0, 1, 15, 16, 33, 34, 37):
        alone = attend_q8(lib, q[t : t + 1].clone(), kp, vp, tables, [rows[t]])
        assert torch.equal(alone, got[t : t + 1]), t
    split = torch.cat([attend_q8(lib, q[1:12].clone(), kp, vp, tables, rows[1:12]),
                       attend_q8(lib, q[12:34].clone(), kp, vp, tables, rows[12:34])])
    assert torch.equal(split, got[1:34])


def test_window_and_sinks_match_the_reference(lib):
    kp, vp = random_pools(2, 64, blocks=60, seed=3)
    tables = torch.arange(60, dtype=torch.int32).view(1, 60)
    n_keys = [700, 513, 40, 1]
    lo = [900 - 700, 600 - 513, 40 - 40, 0]  # rows at positions 899, 599, 39, 0 seeing the last keys
    rows = [(0, n) for n in n_keys]
    q = torch.randn(4, 6, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0, -3.0])
    got = attend_q8(lib, q, kp, vp, tables, rows, lo=lo, sinks=sinks)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), reference(q.float(), kp, vp, tables, rows, lo, sinks), rtol=1e-2,
                               atol=1e-2)
    alone = attend_q8(lib, q[1:2].clone(), kp, vp, tables, rows[1:2], lo=lo[1:2], sinks=sinks)
    assert torch.equal(alone, got[1:2])


def test_refuses_head_sizes_off_the_block(lib):
    q = torch.randn(1, 2, 48)
    kp = torch.zeros(1, BLOCK, 1, 51, dtype=torch.uint8)
    seq, lens = torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    tables = torch.zeros(1, 1, dtype=torch.int32)
    rc = lib.qmm_paged_attention_q8(q.data_ptr(), 0, 1, 2, 48, kp.data_ptr(), kp.data_ptr(), BLOCK, 1,
                                    tables.data_ptr(), 1, seq.data_ptr(), None, lens.data_ptr(), None, 1.0,
                                    torch.empty_like(q).data_ptr())
    assert rc == -1


@pytest.mark.parametrize("heads,hkv,d", LAYOUTS + [(10, 5, 64), (5, 1, 64), (12, 2, 32), (7, 1, 96)])
def test_vnni_paths_give_the_avx2_bits(heads, hkv, d):
    """The VNNI variant's own score and weighed-sum paths ((q + 128) . k - 128 sum k; each value row walked once,
    groups of up to 6 query heads) compute the AVX2 variant's integers and sums in its order: the same bits."""
    variants = cpu_native.supported_variants()
    if not {"avx512vnni", "avx2"} <= set(variants):
        pytest.skip("needs a CPU with AVX-512 VNNI")
    kp, vp = random_pools(hkv, d, blocks=80, seed=5)
    tables = torch.randperm(80, generator=torch.Generator().manual_seed(6)).view(2, 40).to(torch.int32)
    rows = [(0, 640), (1, 515), (1, 33), (0, 7)]
    q = torch.randn(len(rows), heads, d, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    vnni = attend_q8(cpu_native.load("avx512vnni"), q, kp, vp, tables, rows)
    assert torch.equal(vnni, attend_q8(cpu_native.load("avx2"), q, kp, vp, tables, rows))
