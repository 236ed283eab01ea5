"""The native paged attention (kernels/cpu/src/attention.c): a prompt chunk's rows, computed a block of rows at a time,
give the bits each row gets alone (as a decode row) and under any other chunking or batch, for the head layouts the
blocked path takes (GQA groups of 1 to 8, head sizes that are and are not multiples of 16) and for the per-row
path it leaves to the others; both stay close to a float64 reference; and the softmax's vectorized exp keeps
expf's special cases and accuracy."""

from __future__ import annotations

import ctypes
import math

import pytest
import torch

from edgeserve.kernels.cpu import native as cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no native CPU kernels here")
BLOCK = 16


@pytest.fixture(scope="module", params=cpu_native.supported_variants())
def lib(request):
    return cpu_native.load(request.param)


# kernels/cpu/include/kv_q8.h's pool formats
POOL_FORMAT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 3}


def queries(t: int, heads: int, d: int, pool_dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random queries in the dtype that goes with a pool of `pool_dtype` (float32 beside a float16 pool)."""
    q = torch.randn(t, heads, d, generator=torch.Generator().manual_seed(seed))
    return q if pool_dtype == torch.float16 else q.to(pool_dtype)


def pools(heads_kv: int, d: int, dtype: torch.dtype, blocks: int = 24, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(blocks, BLOCK, heads_kv, d, generator=g) * 2).to(dtype)
    v = torch.randn(blocks, BLOCK, heads_kv, d, generator=g).to(dtype)
    return k, v


def attend(lib, q, k, v, tables, rows: list[tuple[int, int]]) -> torch.Tensor:
    """q [T, H, D] with row t of sequence rows[t][0] seeing rows[t][1] positions; returns out [T, H, D]."""
    t, h, d = q.shape
    seq = torch.tensor([s for s, _ in rows], dtype=torch.int32)
    lens = torch.tensor([n for _, n in rows], dtype=torch.int32)
    out = torch.empty_like(q)
    lib.qmm_paged_attention(q.data_ptr(), q.dtype == torch.bfloat16, t, h, d, k.data_ptr(), v.data_ptr(),
                            POOL_FORMAT[k.dtype], BLOCK, k.shape[2], tables.data_ptr(), tables.stride(0),
                            seq.data_ptr(), lens.data_ptr(), d ** -0.5, out.data_ptr())
    return out


def reference(q, k, v, tables, rows: list[tuple[int, int]]) -> torch.Tensor:
    """The same attention in float64, row by row."""
    _, h, d = q.shape
    group = h // k.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for t, (s, n) in enumerate(rows):
        keys = torch.arange(n)
        where = tables[s][keys // BLOCK].long() * BLOCK + keys % BLOCK
        kk = k.flatten(0, 1)[where].double().repeat_interleave(group, dim=1)  # [n, H, D]
        vv = v.flatten(0, 1)[where].double().repeat_interleave(group, dim=1)
        if n:
            w = torch.softmax(torch.einsum("hd,nhd->hn", q[t].double(), kk) * d ** -0.5, dim=-1)
            out[t] = torch.einsum("hn,nhd->hd", w, vv)
    return out


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32)


# (query heads, kv heads, head size): the default model's, one kv head for 8 query heads (a group the values'
# loop splits) with a head size not a multiple of 16, no GQA, a group of 5, and a head size the per-row path takes
LAYOUTS = [(9, 3, 64), (8, 1, 72), (4, 4, 32), (10, 2, 40), (6, 2, 30)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("heads,heads_kv,d", LAYOUTS)
def test_chunk_rows_are_the_bits_of_each_row_alone(lib, heads, heads_kv, d, dtype):
    k, v = pools(heads_kv, d, dtype)
    tables = torch.randperm(24, generator=torch.Generator().manual_seed(1))[:21].view(3, 7).to(torch.int32)
    # a decode row, a 45-row chunk over 50 cached positions, a fresh 9-row prompt, another decode row
    rows = [(2, 71)] + [(0, n) for n in range(51, 96)] + [(1, n) for n in range(1, 10)] + [(2, 112)]
    q = queries(len(rows), heads, d, dtype, 2)
    got = attend(lib, q, k, v, tables, rows)
    torch.testing.assert_close(got.double(), reference(q, k, v, tables, rows), rtol=0.02, atol=0.02)
    for t in (0, 1, 2, 17, 44, 45, 46, 54, 55):
        assert torch.equal(bits(attend(lib, q[t:t + 1], k, v, tables, rows[t:t + 1])), bits(got[t:t + 1])), t
    # the chunk cut elsewhere (13 + 32 rows), alone and behind other rows
    assert torch.equal(bits(attend(lib, q[1:14], k, v, tables, rows[1:14])), bits(got[1:14]))
    assert torch.equal(bits(attend(lib, q[14:], k, v, tables, rows[14:])), bits(got[14:]))


@pytest.mark.parametrize("heads,heads_kv,d", LAYOUTS)
def test_a_float16_pool_gives_the_bits_of_its_float32_values(lib, heads, heads_kv, d):
    """A float16 pool (the CPU's default KV cache beside bf16 compute) is read as its exact float32 values: the
    result is the float32 pool's bit for bit, on the blocked path (a chunk), the row path (decode rows) and across
    key segments; where the pool is float16 but the values are not, it differs."""
    k, v = pools(heads_kv, d, torch.float16, blocks=80, seed=11)
    tables = torch.randperm(80, generator=torch.Generator().manual_seed(12))[:72].view(2, 36).to(torch.int32)
    rows = [(0, 430)] + [(1, n) for n in range(500, 530)] + [(0, 7)]
    q = queries(len(rows), heads, d, torch.float16, 13)
    got = attend(lib, q, k, v, tables, rows)
    assert torch.equal(bits(got), bits(attend(lib, q, k.float(), v.float(), tables, rows)))
    assert not torch.equal(got, attend(lib, q, k.float() * 1.001, v.float(), tables, rows))


def test_rows_that_see_nothing_give_zeros(lib):
    k, v = pools(3, 64, torch.bfloat16)
    tables = torch.arange(24, dtype=torch.int32).view(3, 8)
    rows = [(0, 0), (1, 5), (1, 6), (2, 0)]
    q = torch.randn(4, 9, 64).bfloat16()
    got = attend(lib, q, k, v, tables, rows)
    assert not got[0].any() and not got[3].any()
    assert got[1].abs().sum() > 0 and torch.equal(bits(attend(lib, q[1:3], k, v, tables, rows[1:3])), bits(got[1:3]))


def native_exp(lib, x: torch.Tensor) -> torch.Tensor:
    lib.qmm_exp.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.qmm_exp.restype = None
    x = x.float().contiguous()
    out = torch.empty_like(x)
    lib.qmm_exp(x.data_ptr(), x.numel(), out.data_ptr())
    return out


def test_softmax_exp_special_cases_and_accuracy(lib):
    special = torch.tensor([0.0, -0.0, -math.inf, math.inf, math.nan, -88.0, -103.0, -103.5, -104.0, -1000.0, 88.5,
                            89.0, 1e-30, -1e-30])
    got = native_exp(lib, special)
    want = torch.tensor([1.0, 1.0, 0.0, math.inf, math.nan, math.exp(-88.0), math.exp(-103.0), 2.0 ** -149, 0.0,
                         0.0, math.exp(88.5), math.inf, 1.0, 1.0])
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~want.isnan()], want[~want.isnan()].float())
    # within one float32 ulp of exp in float64 over the softmax's range (and an odd count, for the tail)
    x = torch.linspace(-104.0, 0.0, 200_001)
    got = native_exp(lib, x).double()
    exact = torch.exp(x.double())
    ulp = torch.nextafter(exact.float(), torch.tensor(math.inf)).double() - exact.float().double()
    assert ((got - exact).abs() <= ulp).all()


SEGMENT = 512  # attention.c's KEY_SEGMENT: a row's keys are split at multiples of it


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("heads,heads_kv,d", LAYOUTS)
def test_rows_over_several_key_segments_are_the_bits_of_each_row_alone(lib, heads, heads_kv, d, dtype):
    """Rows deeper than one key segment (their keys split at fixed positions, computed as tasks of their own and
    combined) give the bits they get alone and under another chunking or batch: a chunk crossing the segment
    boundaries at 512 and 1,024, decode rows deeper than one, two and three segments, and a row with fewer keys
    than one segment, next to each other; all close to the float64 reference."""
    blocks = 220
    k, v = pools(heads_kv, d, dtype, blocks=blocks, seed=3)
    tables = torch.randperm(blocks, generator=torch.Generator().manual_seed(4))[:208].view(2, 104).to(torch.int32)
    # decode rows at 513 and 1,600 positions, a 40-row chunk across 512 (490 .. 529), a short row, a 30-row chunk
    # across 1,024, a row of exactly two segments, and one 2 keys past three
    rows = ([(0, 513), (1, 1600)] + [(0, n) for n in range(490, 530)] + [(1, 7)]
            + [(1, n) for n in range(1010, 1040)] + [(0, 2 * SEGMENT), (0, 3 * SEGMENT + 2)])
    q = queries(len(rows), heads, d, dtype, 5)
    got = attend(lib, q, k, v, tables, rows)
    torch.testing.assert_close(got.double(), reference(q, k, v, tables, rows), rtol=0.02, atol=0.02)
    for t in range(len(rows)):
        assert torch.equal(bits(attend(lib, q[t:t + 1], k, v, tables, rows[t:t + 1])), bits(got[t:t + 1])), rows[t]
    # the chunks cut elsewhere, alone and behind other rows
    assert torch.equal(bits(attend(lib, q[2:25], k, v, tables, rows[2:25])), bits(got[2:25]))
    assert torch.equal(bits(attend(lib, q[25:50], k, v, tables, rows[25:50])), bits(got[25:50]))
    assert torch.equal(bits(attend(lib, q[50:], k, v, tables, rows[50:])), bits(got[50:]))



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("heads,heads_kv,d", LAYOUTS)
def test_a_batch_of_decode_rows_is_the_bits_of_each_row_alone_and_in_a_chunk(lib, heads, heads_kv, d, dtype):
    """Decode rows batched (one row per sequence: the row path, one task per row over all kv heads once there are
    as many rows as threads) give the bits each row gets alone (a task per kv head) and the bits the same query gets
    as a row of a prompt chunk (the blocked path), at depths under, at and over a key segment; all close to the
    float64 reference."""
    lens = [1, 5, 16, 17, 129, 300, SEGMENT, SEGMENT + 1, 700, 2 * SEGMENT + 6]
    per_seq = (max(lens) + 4 + BLOCK - 1) // BLOCK  # room for the chunks' rows past each length
    blocks = per_seq * len(lens) + 5
    k, v = pools(heads_kv, d, dtype, blocks=blocks, seed=6)
    perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(7))
    tables = perm[:per_seq * len(lens)].view(len(lens), per_seq).to(torch.int32).contiguous()
    rows = [(s, n) for s, n in enumerate(lens)]
    q = queries(len(rows), heads, d, dtype, 8)
    got = attend(lib, q, k, v, tables, rows)
    torch.testing.assert_close(got.double(), reference(q, k, v, tables, rows), rtol=0.02, atol=0.02)
    for t in range(len(rows)):
        assert torch.equal(bits(attend(lib, q[t:t + 1], k, v, tables, rows[t:t + 1])), bits(got[t:t + 1])), rows[t]
    # each decode row's query as the 3rd row of a 6-row chunk of its own sequence
    for t, (s, n) in enumerate(rows):
        if n < 3:
            continue
        chunk = [(s, m) for m in range(n - 2, n + 4)]
        qc = queries(len(chunk), heads, d, dtype, 9 + t)
        qc[2] = q[t]
        assert torch.equal(bits(attend(lib, qc, k, v, tables, chunk)[2]), bits(got[t])), rows[t]


def attend_window(lib, q, k, v, tables, rows: list[tuple[int, int]], window: int) -> torch.Tensor:
    """attend() for a sliding-window layer: row t sees the last `window` of its rows[t][1] positions."""
    t, h, d = q.shape
    seq = torch.tensor([s for s, _ in rows], dtype=torch.int32)
    lo, seen = cpu_native.window_rows(torch.tensor([n for _, n in rows], dtype=torch.int32), window)
    out = torch.empty_like(q)
    cpu_native._bind(lib).qmm_paged_attention_from(
        q.data_ptr(), q.dtype == torch.bfloat16, t, h, d, k.data_ptr(), v.data_ptr(), k.dtype == torch.bfloat16,
        BLOCK, k.shape[2], tables.data_ptr(), tables.stride(0), seq.data_ptr(), lo.data_ptr(), seen.data_ptr(),
        d ** -0.5, out.data_ptr())
    return out


def window_reference(q, k, v, tables, rows: list[tuple[int, int]], window: int) -> torch.Tensor:
    """The windowed attention in float64: keys n - window .. n - 1 of each row (from 0 when n <= window)."""
    _, h, d = q.shape
    group = h // k.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for t, (s, n) in enumerate(rows):
        keys = torch.arange(max(0, n - window), n)
        where = tables[s][keys // BLOCK].long() * BLOCK + keys % BLOCK
        kk = k.flatten(0, 1)[where].double().repeat_interleave(group, dim=1)
        vv = v.flatten(0, 1)[where].double().repeat_interleave(group, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[t].double(), kk) * d ** -0.5, dim=-1)
        out[t] = torch.einsum("hn,nhd->hd", w, vv)
    return out


@pytest.mark.parametrize("window", [40, SEGMENT + 88])
@pytest.mark.parametrize("heads,heads_kv,d", [LAYOUTS[0], LAYOUTS[1], LAYOUTS[4]])
def test_sliding_window_rows_see_their_last_keys_whatever_the_batch(lib, heads, heads_kv, d, window):
    """A sliding-window layer's rows (qmm_paged_attention_from): each sees only its last `window` positions (close
    to the float64 reference), a row gives the same bits alone, in a prompt chunk (rows starting past 0 are the
    row path's, the others stay blocked) or next to other rows, and a row still inside its window gets the bits of
    the plain call."""
    dtype = torch.bfloat16
    blocks = 130
    k, v = pools(heads_kv, d, dtype, blocks=blocks, seed=10)
    tables = torch.randperm(blocks, generator=torch.Generator().manual_seed(11))[:124].view(2, 62).to(torch.int32)
    # a chunk that crosses the window's edge (rows before it start at 0, rows after it past 0), decode rows
    # inside and far past the window, and a row exactly at it
    rows = ([(0, n) for n in range(window - 6, window + 20)] + [(1, 9), (1, 3 * window // 2), (1, window),
                                                                (0, 800)])
    q = torch.randn(len(rows), heads, d, generator=torch.Generator().manual_seed(12)).to(dtype)
    got = attend_window(lib, q, k, v, tables, rows, window)
    torch.testing.assert_close(got.double(), window_reference(q, k, v, tables, rows, window), rtol=0.02, atol=0.02)
    for t in range(len(rows)):
        alone = attend_window(lib, q[t:t + 1], k, v, tables, rows[t:t + 1], window)
        assert torch.equal(bits(alone), bits(got[t:t + 1])), rows[t]
    inside = [t for t, (_, n) in enumerate(rows) if n <= window]
    plain = attend(lib, q[inside], k, v, tables, [rows[t] for t in inside])
    assert torch.equal(bits(plain), bits(got[inside]))
    assert torch.equal(bits(attend_window(lib, q[3:20], k, v, tables, rows[3:20], window)), bits(got[3:20]))
