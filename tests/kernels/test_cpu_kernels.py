"""The native CPU matmuls over GGUF blocks (kernels/cpu/src/qmm/) against a float64 dequantize-then-matmul
reference (gguf's own dequantizer), for every format, every SIMD variant this CPU has plus the portable one,
odd shapes and batches of 1 to 65; and that the library really builds where a compiler exists."""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.cpu.native import FORMATS, GGUF_QTYPES, INTERLEAVED, REPACKED, BlockTensor, BlockWeight

GGUF_FORMATS = sorted(GGUF_QTYPES)  # the _R8 / _X8 layouts are made by repacking

# byte offsets of each block's float16 scale fields (d, and m / dmin where there is one)
SCALE_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2],
                "Q5_K": [0, 2], "Q6_K": [208]}
# byte offsets of each block's E8M0 exponent (a power-of-two scale)
EXPONENT_FIELDS = {"MXFP4": [0]}


def random_blocks(qtype: str, rows: int, cols: int, gen: np.random.Generator) -> BlockTensor:
    """Random block bytes of `qtype` for a [rows, cols] weight, with small finite float16 scales (or exponents of
    scales from 2^-11 to 2^-2)."""
    _, per, size = FORMATS[qtype]
    data = gen.integers(0, 256, size=(rows, cols // per, size), dtype=np.uint8)
    for off in EXPONENT_FIELDS.get(qtype, []):
        data[:, :, off] = gen.integers(117, 127, size=(rows, cols // per), dtype=np.uint8)
    for off in SCALE_FIELDS.get(qtype, []):
        scale = (gen.random((rows, cols // per)) * 0.02 + 0.001).astype(np.float16)
        if qtype in ("Q4_1", "Q5_1") and off == 2:
            scale = -scale  # the offset m of these formats is usually negative
        data[:, :, off:off + 2] = scale.view(np.uint8).reshape(rows, cols // per, 2)
    return BlockTensor(qtype, torch.from_numpy(data.reshape(rows, -1).copy()), cols)


def reference(x: torch.Tensor, w: BlockTensor) -> torch.Tensor:
    """x @ W.T in float64 from gguf's dequantization of the blocks."""
    deq = dequantize(w.data.numpy(), GGMLQuantizationType[w.qtype]).reshape(w.shape)
    return x.double() @ torch.from_numpy(deq).double().T


VARIANTS = cpu_native.supported_variants()


@pytest.fixture(scope="module", params=VARIANTS)
def lib(request):
    return cpu_native.load(request.param)


def test_native_library_builds_where_a_compiler_exists():
    if cpu_native.compiler() is None:
        pytest.skip("no C compiler on this machine")
    for variant in VARIANTS:
        assert cpu_native.load(variant).qmm_variant().decode() == variant
    assert cpu_native.available()  # a broken build must fail here, not fall back silently


def test_every_variant_compiles_even_where_the_cpu_cannot_run_it():
    """The AVX-512 VNNI build shares the AVX2 code; a change there must still compile on an AVX2-only machine."""
    if cpu_native.compiler() is None:
        pytest.skip("no C compiler on this machine")
    for variant in cpu_native.compilable_variants():
        assert cpu_native.build(variant).stat().st_size > 0


@pytest.mark.parametrize("qtype", GGUF_FORMATS)
@pytest.mark.parametrize("rows,cols_blocks,batch", [(1, 1, 1), (37, 1, 5), (19, 2, 65), (70, 3, 8), (16, 1, 4),
                                                    (13, 19, 6), (24, 3, 9), (8, 2, 65)])  # rows % 8 == 0: _X8 bands
def test_matmul_matches_float64_reference(lib, qtype, rows, cols_blocks, batch):
    gen = np.random.default_rng(hash((qtype, rows, batch)) & 0xFFFF)
    cols = FORMATS[qtype][1] * cols_blocks
    w = random_blocks(qtype, rows, cols, gen)
    x = torch.from_numpy(gen.standard_normal((batch, cols)).astype(np.float32))
    got = BlockWeight([w], lib).matmul(x).double()
    want = reference(x, w)
    # int8 activations: each block's rounding error is at most half a step of amax/127
    err = (got - want).abs().max().item()
    scale = (x.double().abs() @ torch.from_numpy(
        np.abs(dequantize(w.data.numpy(), GGMLQuantizationType[qtype]).reshape(w.shape))).double().T).max().item()
    assert err <= 0.01 * scale, (qtype, err, scale)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("qtype", GGUF_FORMATS)
@pytest.mark.parametrize("cols_blocks", [2, 19])  # 19 blocks of 32: two repacked groups of 8 and a tail of 3
@pytest.mark.parametrize("rows", [9, 16])  # 16: the _X8 bands
def test_rows_dequantize_exactly(lib, qtype, cols_blocks, rows):
    gen = np.random.default_rng(7)
    w = random_blocks(qtype, rows, FORMATS[qtype][1] * cols_blocks, gen)
    ids = torch.tensor([3, 0, rows - 1, 3])
    want = torch.from_numpy(dequantize(w.data.numpy(), GGMLQuantizationType[qtype]).reshape(w.shape))[ids]
    torch.testing.assert_close(BlockWeight([w], lib).rows(ids), want, rtol=0, atol=0)


def test_parts_of_mixed_formats_and_bf16_input(lib):
    gen = np.random.default_rng(3)
    parts = [random_blocks("Q4_K", 40, 512, gen), random_blocks("Q6_K", 24, 512, gen),
             random_blocks("Q8_0", 8, 512, gen)]
    x = torch.from_numpy(gen.standard_normal((6, 512)).astype(np.float32)).bfloat16()
    got = BlockWeight(parts, lib).matmul(x).double()
    want = torch.cat([reference(x.float(), p) for p in parts], dim=1)
    assert (got - want).abs().max().item() <= 0.01 * want.abs().max().item()


@pytest.mark.parametrize("qtype", GGUF_FORMATS)
@pytest.mark.parametrize("rows", [101, 96])  # 96: the _X8 bands
def test_rows_are_batch_invariant(lib, qtype, rows):
    """A row's result is the same bits whatever else is in the batch (decode vs. prefill, any batch size): the
    kernels' tiles (weight rows x activation rows) differ by batch, the per-output arithmetic must not."""
    gen = np.random.default_rng(5)
    w = BlockWeight([random_blocks(qtype, rows, 1280, gen)], lib)  # 40 blocks of 32: repacked groups and a tail
    x = torch.from_numpy(gen.standard_normal((33, 1280)).astype(np.float32))
    full = w.matmul(x)
    for i in (0, 17, 32):
        assert torch.equal(w.matmul(x[i:i + 1])[0], full[i])
    for lo, hi in ((5, 12), (1, 3), (20, 23), (8, 16), (0, 33)):  # tiles of 1 to 8 rows
        assert torch.equal(w.matmul(x[lo:hi]), full[lo:hi])


def test_every_variant_agrees_with_the_scalar_one():
    gen = np.random.default_rng(11)
    x = torch.from_numpy(gen.standard_normal((7, 512)).astype(np.float32))
    for qtype in GGUF_FORMATS:
        for rows in (33, 32):
            w = random_blocks(qtype, rows, 512, gen)
            base = BlockWeight([w], cpu_native.load("scalar")).matmul(x)
            for variant in VARIANTS:
                got = BlockWeight([w], cpu_native.load(variant)).matmul(x)
                torch.testing.assert_close(got, base, rtol=1e-4, atol=1e-4 * base.abs().max().item())


@pytest.mark.skipif(not {"avx2", "avx512vnni"} <= set(VARIANTS), reason="needs a CPU with AVX-512 VNNI")
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q8_0"])
def test_vnni_k_quants_give_the_avx2_bits(qtype):
    """The VNNI build's K-quant and Q8_0 bands (dpbusd, 8 rows or 16 rows at a time; Q8_0's weights offset to
    unsigned and 128 x the activation sum taken off) sum the same integers as the AVX2 build's maddubs, in any batch
    size: the same bits, so batch invariance holds across the 8- and 16-row passes."""
    gen = np.random.default_rng(9)
    w = random_blocks(qtype, 104, 768, gen)  # 13 bands: pairs of bands and a lone one
    x = torch.from_numpy(gen.standard_normal((37, 768)).astype(np.float32))
    vnni, avx2 = (BlockWeight([w], cpu_native.load(v)) for v in ("avx512vnni", "avx2"))
    for rows in (x, x[:1], x[3:7], x[:8], x[:19]):
        assert torch.equal(vnni.matmul(rows), avx2.matmul(rows))


def test_activation_blocks_are_the_same_bits_in_every_variant():
    """The SIMD activation quantizer gives the scalar one's int8 values, scales and sums exactly (ties at half a
    step, all-zero blocks, bf16 and float32, rows split over threads or not)."""
    gen = np.random.default_rng(5)
    for rows, cols in ((1, 32), (3, 576), (9, 2048), (40, 1536)):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.from_numpy(gen.standard_normal((rows, cols)).astype(np.float32) * 3).to(dtype)
            x[0, :32] = 0
            x[-1, -32:] = torch.arange(-16, 16, dtype=torch.float32).to(dtype) * 0.5  # ties: k + 0.5 steps
            want = BlockWeight([random_blocks("Q8_0", 8, cols, gen)], cpu_native.load("scalar")).quantize(x)
            for variant in VARIANTS:
                got = BlockWeight([random_blocks("Q8_0", 8, cols, gen)], cpu_native.load(variant)).quantize(x)
                for a, b in zip(got, want):
                    assert torch.equal(a, b), variant


def test_silu_mul_is_the_same_bits_in_every_variant():
    """SiLU-and-mul with its exponentials a chunk at a time (SIMD where the variant has it, over threads) gives the
    scalar build's bits, which are libm's expf per value."""
    gen = np.random.default_rng(6)
    for rows, f in ((1, 1536), (8, 1536), (3, 700)):
        x = torch.from_numpy(gen.standard_normal((rows, 2 * f)).astype(np.float32) * 5)
        x[0, :3] = torch.tensor([95.0, -95.0, 0.0])  # exp overflow / underflow cases
        outs = {}
        for variant in VARIANTS:
            out = torch.empty(rows, f)
            cpu_native.load(variant).qmm_silu_mul(x.data_ptr(), 0, 2 * f, rows, f, out.data_ptr())
            outs[variant] = out
        for variant, out in outs.items():
            assert torch.equal(out, outs["scalar"]), variant
        expf = ctypes.CDLL(None).expf  # libm's, value by value, in float32 arithmetic around it
        expf.argtypes, expf.restype = [ctypes.c_float], ctypes.c_float
        g, u = x[0, :f].numpy(), x[0, f:].numpy()
        e = np.array([expf(-float(v)) for v in g], dtype=np.float32)
        assert np.array_equal(outs["scalar"][0].numpy(), g / (np.float32(1) + e) * u)


def test_rope_rows_are_the_same_bits_on_the_simd_and_the_scalar_loop():
    """RoPE + K/V write of float32 rows (8 values at a time where the variant has SIMD) gives the bits of the
    element-by-element loop, which bfloat16 input takes: the same values fed both ways."""
    gen = np.random.default_rng(8)
    h, hkv, d, t = 4, 2, 64, 3
    qkv = torch.from_numpy(gen.standard_normal((t, (h + 2 * hkv) * d)).astype(np.float32) * 8).bfloat16()
    cos = torch.from_numpy(gen.standard_normal((t, d // 2)).astype(np.float32))
    sin = torch.from_numpy(gen.standard_normal((t, d // 2)).astype(np.float32))
    slots = torch.tensor([3, 0, 7])
    for variant, cache_dtype in itertools.product(VARIANTS, (torch.float32, torch.bfloat16)):
        lib = cpu_native.load(variant)
        outs = []
        for x in (qkv.float(), qkv):  # float32 rows (SIMD) and the same values in bfloat16 (the scalar loop)
            caches = [torch.zeros(8, hkv, d, dtype=cache_dtype) for _ in range(2)]
            out = torch.empty(t, h, d, dtype=cache_dtype)
            n = x.shape[1]
            lib.qmm_rope_write_kv(x.data_ptr(), x.data_ptr() + x.element_size() * h * d,
                                  x.data_ptr() + x.element_size() * (h + hkv) * d, x.dtype == torch.bfloat16, n, n, n,
                                  cos.data_ptr(), sin.data_ptr(), caches[0].data_ptr(), caches[1].data_ptr(),
                                  cache_dtype == torch.bfloat16, slots.data_ptr(), t, h, hkv, d, out.data_ptr())
            outs.append((out, *caches))
        for a, b in zip(*outs):
            assert torch.equal(a, b), (variant, cache_dtype)


def assert_rewritten_once(w: BlockTensor, lib, qtype: str) -> None:
    """`w` is rewritten at load into layout `qtype` (same bytes per row, other bytes), every value the same, and a
    weight built from the rewritten part is not rewritten twice."""
    bw = BlockWeight([w], lib)
    part = bw.parts[0]
    assert part.qtype == qtype and part.data.shape == w.data.shape
    assert not torch.equal(part.data, w.data)
    want = torch.from_numpy(dequantize(w.data.numpy(), GGMLQuantizationType[w.qtype]).reshape(w.shape))
    torch.testing.assert_close(bw.dequantize(), want, rtol=0, atol=0)
    assert torch.equal(BlockWeight([part], lib).parts[0].data, part.data)


@pytest.mark.parametrize("qtype", sorted(REPACKED))
def test_repacked_formats_keep_the_values_and_size(lib, qtype):
    """Q4_0 / Q4_1 weights are rewritten at load into their _R8 layout (same bytes per row, new format id):
    every value stays the same, and a weight built from the repacked part is not repacked twice."""
    gen = np.random.default_rng(13)
    w = random_blocks(qtype, 7, 32 * 27, gen)  # three groups of 8 blocks and a tail of 3
    assert_rewritten_once(w, lib, REPACKED[qtype])


@pytest.mark.parametrize("qtype", sorted(INTERLEAVED))
def test_interleaved_formats_keep_the_values_and_size(lib, qtype):
    """Weights of a multiple of 8 rows are rewritten at load into bands of 8 interleaved rows (_X8: same bytes,
    new format id): every value stays the same, and a weight built from the repacked part is not repacked twice;
    other row counts keep their GGUF (or _R8) layout."""
    gen = np.random.default_rng(17)
    per = FORMATS[qtype][1]
    w = random_blocks(qtype, 24, per * (3 if per == 256 else 19), gen)
    assert_rewritten_once(w, lib, INTERLEAVED[qtype])
    odd = BlockWeight([BlockTensor(qtype, w.data[:23].clone(), w.cols)], lib).parts[0]
    assert odd.qtype == REPACKED.get(qtype, qtype)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("EDGESERVE_NATIVE", "0")
    assert cpu_native.library() is None
    assert not cpu_native.available()


def test_paged_attention_matches_the_float64_twin_and_is_batch_invariant(lib):
    from edgeserve.kernels.torch.paged_attention import AttentionMetadata
    from edgeserve.kernels.torch.paged_attention import paged_attention as twin

    torch.manual_seed(0)
    bs, hkv, heads, d = 4, 2, 6, 32
    k_cache = torch.randn(20, bs, hkv, d).bfloat16()
    v_cache = torch.randn(20, bs, hkv, d).bfloat16()
    tables = [[3, 7, 1], [0, 5, 9, 11, 2], [4]]
    qlens, slens = [1, 6, 3], [9, 17, 3]  # a decode, a prefill chunk over cached context, a fresh prompt
    q = torch.randn(sum(qlens), heads, d).bfloat16()
    meta = AttentionMetadata.build(qlens, slens, tables, list(range(sum(qlens))))
    got = cpu_native.paged_attention(q, k_cache, v_cache, meta, None, lib)
    want = twin(q, k_cache, v_cache, AttentionMetadata.build(qlens, slens, tables, list(range(sum(qlens)))))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.02)
    # the prefill's last 2 rows alone (as a later chunk would run them) give the same bits
    alone = AttentionMetadata.build([2], [17], [tables[1]], [0, 1])
    assert torch.equal(cpu_native.paged_attention(q[5:7], k_cache, v_cache, alone, None, lib), got[5:7])


def rope_write_kv_both(cache_dtype: torch.dtype, slots: list[int]):
    """Rotate random bf16 q, k, v of 3 tokens (q of 2 heads, k and v of 1, as views of one fused matmul output) and
    write K/V into `cache_dtype` pools at `slots`, natively and by the torch twin: (native q, twin q, [native K,
    native V, twin K, twin V])."""
    from edgeserve.kernels.torch import rope

    qkv = torch.randn(3, 4 * 16).bfloat16()
    q, k, v = qkv[:, :32].view(3, 2, 16), qkv[:, 32:48].view(3, 1, 16), qkv[:, 48:].view(3, 1, 16)
    cos, sin = torch.randn(3, 8), torch.randn(3, 8)
    caches = [torch.zeros(2, 4, 1, 16, dtype=cache_dtype) for _ in range(4)]
    at = torch.tensor(slots)
    got_q = cpu_native.rope_write_kv(q, k, v, cos, sin, caches[0], caches[1], at)
    want_q = rope.rope_write_kv(q, k, v, cos, sin, caches[2], caches[3], at)
    return got_q, want_q, caches


def test_fused_elementwise_kernels_match_the_twins():
    from edgeserve.kernels.torch import activation
    from edgeserve.kernels.torch import norm

    torch.manual_seed(1)
    x, res, w = torch.randn(5, 64).bfloat16(), torch.randn(5, 64), torch.randn(64)
    got, new_res = cpu_native.add_rms_norm(x, res, w, 1e-6, torch.bfloat16)
    want, want_res = norm.add_rms_norm(x, res, w, 1e-6, torch.bfloat16)
    assert torch.equal(new_res, want_res)
    torch.testing.assert_close(got.float(), want.float(), rtol=0.01, atol=0.01)
    torch.testing.assert_close(cpu_native.add_rms_norm(res, None, w, 1e-6, torch.float32)[0],
                               norm.rms_norm(res, w, 1e-6), rtol=1e-5, atol=1e-5)
    gate_up = torch.randn(5, 128)
    torch.testing.assert_close(cpu_native.silu_and_mul(gate_up), activation.silu_and_mul(gate_up), rtol=1e-5,
                               atol=1e-5)
    wide = torch.cat([torch.linspace(-12, 12, 1000).expand(5, -1), torch.randn(5, 1000)], dim=1)  # [gate | up]
    wide[0, :2] = torch.tensor([60.0, -60.0])  # exp overflow / underflow: GELU is x and -0 there
    torch.testing.assert_close(cpu_native.gelu_tanh_and_mul(wide), activation.gelu_tanh_and_mul(wide),
                               rtol=1e-5, atol=1e-6)
    got_q, want_q, caches = rope_write_kv_both(torch.bfloat16, [0, 5, 6])
    torch.testing.assert_close(got_q.float(), want_q.float(), rtol=0.01, atol=0.02)
    torch.testing.assert_close(caches[0].float(), caches[2].float(), rtol=0.01, atol=0.02)
    assert torch.equal(caches[1], caches[3])


def test_rope_write_kv_and_attention_over_an_f16_pool_match_the_twins():
    """The CPU's default KV cache beside bf16 compute: bf16 q, k, v rotated in float32, K and V stored as float16
    (V exactly the twin's cast), q returned float32; the attention over that pool takes float32 queries and gives
    the twin's result."""
    from edgeserve.kernels.torch.paged_attention import AttentionMetadata
    from edgeserve.kernels.torch.paged_attention import paged_attention as twin

    torch.manual_seed(2)
    got_q, want_q, caches = rope_write_kv_both(torch.float16, [0, 1, 2])
    assert got_q.dtype == want_q.dtype == torch.float32
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[0].float(), caches[2].float(), rtol=1e-3, atol=1e-3)
    assert caches[0].dtype == torch.float16 and torch.equal(caches[1], caches[3])
    meta = AttentionMetadata.build([3], [3], [[0]], [0, 1, 2])
    got = cpu_native.paged_attention(got_q, caches[0], caches[1], meta, None)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, twin(got_q, caches[0], caches[1], meta).float(), rtol=1e-4, atol=1e-4)


def test_without_a_compiler_the_torch_path_runs_with_one_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path))  # nothing cached here
    monkeypatch.setenv("EDGESERVE_NATIVE_VARIANT", "scalar")  # a setting not looked up yet in this test
    monkeypatch.setattr(cpu_native, "compiler", lambda: None)
    monkeypatch.setattr(cpu_native, "_libs", {})
    monkeypatch.setattr(cpu_native, "_chosen", {})
    monkeypatch.setattr(cpu_native, "_warned", False)
    with caplog.at_level("WARNING", logger=cpu_native.__name__):
        assert cpu_native.library() is None
        assert cpu_native.library() is None
    warnings = [r for r in caplog.records if "native CPU kernels unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "slower" in warnings[0].getMessage()


@pytest.mark.parametrize("variant", cpu_native.compilable_variants())
def test_every_variant_compiles(variant):
    """Even the variants this CPU cannot run must compile (their numeric tests run on CPUs that have them)."""
    if cpu_native.compiler() is None:
        pytest.skip("no C compiler on this machine")
    assert cpu_native.build(variant).exists()
