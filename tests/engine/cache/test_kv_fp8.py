"""The fp8 (e4m3 + a float32 scale per row) KV cache on the Triton path, in the interpreter on CPU or on a GPU:
the torch format against float64, the Triton RoPE + K/V write giving the torch twin's bytes, the Triton decode and
prefill kernels over fp8 pools against a float64 reference (odd lengths, block boundaries, GQA, sliding window,
sinks), the pool and tier layout, and the one-line refusal where fp8 cannot run."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICES, assert_close, kernel_device, paged_batch

from edgeserve.engine.cache.kv_cache import KVPool, kv_bytes_per_token
from edgeserve.engine.cache.kv_format import FP8, resolve_kv_format
from edgeserve.kernels import dispatch
from edgeserve.kernels.formats.kv_quant import FP8_MAX, dequantize_fp8, fp8_row_width, quantize_fp8
from edgeserve.kernels.torch.paged_attention import paged_attention as twin
from edgeserve.kernels.torch.rope import rope_write_kv as rope_twin
from edgeserve.models.config import ModelConfig
from edgeserve.offload import KVLayout

def fp8_device(name: str) -> str:
    """kernel_device, and on CUDA a part with fp8 conversions (sm_89+)."""
    device = kernel_device(name)
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs CUDA compute capability 8.9+")
    return device


# (query_lens, seq_lens, block_size): odd lengths, block-boundary ends, decodes and prefills mixed
MIXES = {
    "decode": ([1, 1, 1], [5, 16, 33], 4),
    "prefill": ([7, 19], [7, 37], 8),
    "mixed": ([1, 9, 1, 4], [16, 9, 2, 21], 16),
}


def test_fp8_rows_match_float64_within_e4m3_rounding():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 3, 64, generator=g, dtype=torch.float64) * torch.logspace(-3, 2, 9, dtype=torch.float64)[:, None, None]
    x[0, 0] = 0.0  # an all-zero row: scale 0, values 0
    rows = quantize_fp8(x)
    assert rows.dtype == torch.float8_e4m3fn and rows.shape == (9, 3, fp8_row_width(64)) == (9, 3, 68)
    scale = rows[..., 64:].contiguous().view(torch.float32).double()
    assert torch.equal(scale[0, 0], torch.zeros(1, dtype=torch.float64))
    amax = x.abs().amax(-1, keepdim=True)
    assert torch.allclose(scale, amax / FP8_MAX, rtol=1e-6)
    err = (dequantize_fp8(rows).double() - x).abs()
    # half an e4m3 ulp: 2**-4 relative for normals, 2**-10 of the scale for subnormals (and float32 rounding)
    bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10) + amax * 1e-6
    assert (err <= bound).all(), float((err - bound).max())
    assert float((dequantize_fp8(rows).double() - x).abs().max()) > 0  # it is lossy: the test sees the rounding
    with pytest.raises(ValueError, match="multiple of 4"):
        fp8_row_width(66)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_rope_write_gives_the_twins_fp8_bytes(device):
    device = fp8_device(device)
    g = torch.Generator().manual_seed(1)
    t, h, hk, d, bs = 7, 6, 2, 64, 4
    q, k, v = (torch.randn(t, n, d, generator=g) * s for n, s in ((h, 1), (hk, 30), (hk, 0.01)))
    ang = torch.rand(t, d // 2, generator=g) * 6
    cos, sin = ang.cos(), ang.sin()
    slots = torch.tensor([0, 3, 5, -1, 8, 9, 2])  # -1: a padding token writes nothing
    pools = [torch.zeros(3, bs, hk, d + 4, dtype=torch.float8_e4m3fn) for _ in range(4)]
    to = [x.to(device) for x in (q, k, v, cos, sin, pools[0], pools[1], slots)]
    with dispatch.force_backend("triton"):
        q_out = dispatch.rope_write_kv(*to)
    real = slots >= 0
    expected_q = rope_twin(q[real], k[real], v[real], cos[real], sin[real], pools[2], pools[3], slots[real])
    assert q_out.dtype == torch.float32
    assert torch.allclose(q_out.cpu()[real], expected_q, atol=1e-5)
    for got, want in ((to[5], pools[2]), (to[6], pools[3])):
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
    assert to[5].cpu().view(torch.uint8).view(-1, hk, d + 4)[[1, 4, 6, 7, 10, 11]].eq(0).all()  # untouched slots


def fp8_case(device: str, mix: str, heads: tuple[int, int], head_dim: int, seed: int, window=None, sinks=False):
    """Triton attention over fp8 pools and the float64 twin over their dequantized values."""
    query_lens, seq_lens, block_size = MIXES[mix]
    nh, nkv = heads
    k, v, meta = paged_batch(query_lens, seq_lens, block_size, nkv, head_dim, torch.float32, "cpu", seed)
    k = k * torch.linspace(0.1, 8, head_dim)  # uneven channels, as real K has
    k8, v8 = quantize_fp8(k), quantize_fp8(v)
    q = torch.randn(sum(query_lens), nh, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    s = torch.randn(nh, generator=torch.Generator().manual_seed(seed + 2)) if sinks else None
    dev = dispatch.AttentionMetadata.build(query_lens, seq_lens, meta.block_tables.tolist(),
                                           meta.slot_mapping.tolist(), device=device)
    with dispatch.force_backend("triton"):
        out = dispatch.paged_attention(q.to(device), k8.to(device), v8.to(device), dev, window=window,
                                       sinks=None if s is None else s.to(device))
    expected = twin(q.double(), dequantize_fp8(k8).double(), dequantize_fp8(v8).double(), meta, window=window,
                    sinks=s)
    return out, expected, twin(q, k, v, meta, window=window, sinks=s)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("heads", [(6, 2), (4, 4)], ids=["gqa3", "mha"])
def test_triton_attention_over_fp8_matches_float64(device, mix, heads):
    device = fp8_device(device)
    out, expected, unquantized = fp8_case(device, mix, heads, 64, seed=3)
    assert_close(out, expected, torch.float32)
    # and fp8 is close to attention over the values before quantizing (a scale ignored would be far off)
    assert float((out.cpu() - unquantized).abs().mean()) < 0.03


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mix", ["decode", "mixed"])
def test_triton_fp8_window_and_sinks(device, mix):
    device = fp8_device(device)
    out, expected, _ = fp8_case(device, mix, (6, 2), 32, seed=7, window=5, sinks=True)
    assert_close(out, expected, torch.float32)


def tiny_config() -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=64, hidden_size=256, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4,
                       max_position_embeddings=128, tie_word_embeddings=True)


def test_fp8_pool_layout_and_sizing():
    config = tiny_config()
    assert FP8.row_bytes(64) == 68
    assert kv_bytes_per_token(config, FP8) * 128 == kv_bytes_per_token(config, torch.bfloat16) * 68
    pool = KVPool(config, num_blocks=3, block_size=4, dtype=FP8)
    assert pool.k.dtype == torch.float8_e4m3fn and pool.k.shape[-1] == 68 and pool.kv_dtype == "fp8"
    fp8 = KVLayout("m", torch.float8_e4m3fn, num_layers=2, block_size=4, num_kv_heads=2, head_dim=68, kv_format="fp8")
    q8 = KVLayout("m", torch.uint8, num_layers=2, block_size=4, num_kv_heads=2, head_dim=68, kv_format="q8_0")
    assert fp8.key != q8.key  # the same bytes per block, never read into each other's pool


def test_fp8_is_refused_in_one_line_where_it_cannot_run():
    config = tiny_config()
    with dispatch.force_backend("torch"), pytest.raises(ValueError, match="fp8 needs the Triton kernels") as err:
        resolve_kv_format("fp8", config, torch.bfloat16, "cpu")
    assert "\n" not in str(err.value) and "q8_0" in str(err.value)
    if kernel_device_ok():
        with dispatch.force_backend("triton"):
            assert resolve_kv_format("fp8", config, torch.bfloat16, "cpu") == FP8


def kernel_device_ok() -> bool:
    from edgeserve.kernels.triton.runtime import HAS_TRITON, interpreting

    return HAS_TRITON and interpreting()


def test_engine_serves_fp8_kv_batch_invariant_and_as_the_float64_twin(tmp_path, monkeypatch):
    """A tiny model served with fp8 KV in the interpreter: the pool is fp8, a request's greedy tokens are the same
    alone, chunked or batched, and the same as with the float64 twin attending over the same fp8 pool."""
    kernel_device("cpu")
    from tiny_gguf import write_tiny_llama

    import edgeserve.kernels.triton.paged_attention as triton_attention
    from edgeserve.engine.config import EngineConfig
    from edgeserve.engine.core import EngineCore
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve
    from edgeserve.sampling_params import SamplingParams

    lm = load_model(resolve(str(write_tiny_llama(tmp_path / "tiny.gguf", hidden=128, heads=4, kv_heads=2, ffn=256,
                                                 qtype="Q8_0", seed=4))))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 259, (n,), generator=g).tolist() for n in (13, 21, 9)]

    def serve(batch: list[int], **kw) -> dict[int, list[int]]:
        with dispatch.force_backend("triton"):
            engine = EngineCore(lm, EngineConfig(block_size=8, kv_cache_gb=0.01, kv_cache_dtype="fp8", **kw))
            assert engine.pool.k.dtype == torch.float8_e4m3fn and engine.stats().kv_cache_dtype == "fp8"
            for i in batch:
                engine.add_request(prompts[i], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                                   request_id=str(i))
            outs: dict[int, list[int]] = {}
            while engine.has_work():
                for o in engine.step():
                    outs.setdefault(int(o.request_id), []).extend(o.token_ids)
        return outs

    batched = serve([0, 1, 2])
    assert serve([1], max_num_batched_tokens=8) == {1: batched[1]}  # alone, its prompt in chunks of 8
    monkeypatch.setattr(triton_attention, "paged_attention", lambda q, k, v, meta, scale=None, window=None,
                        sinks=None: twin(q, k, v, meta, scale, window, None, sinks))
    assert serve([0, 1, 2]) == batched


def test_fp8_pools_off_the_triton_path_take_the_torch_twin():
    """Without Triton (here the auto backend on the CPU, whose native kernels take no fp8) an fp8 pool is read by
    the torch twin over its dequantized values, not misread as floats."""
    query_lens, seq_lens, block_size = MIXES["mixed"]
    k, v, meta = paged_batch(query_lens, seq_lens, block_size, 2, 64, torch.float32, "cpu", 11)
    k8, v8 = quantize_fp8(k), quantize_fp8(v)
    q = torch.randn(sum(query_lens), 6, 64, generator=torch.Generator().manual_seed(12))
    out = dispatch.paged_attention(q, k8, v8, meta)
    expected = twin(q.double(), dequantize_fp8(k8).double(), dequantize_fp8(v8).double(), meta)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_disk_tier_round_trips_fp8_blocks_and_refuses_q8_0(tmp_path):
    from edgeserve.offload.block_file import CorruptBlockError, decode
    from edgeserve.offload.disk_tier import DiskTier

    fp8 = KVLayout("m", torch.float8_e4m3fn, num_layers=2, block_size=4, num_kv_heads=2, head_dim=68,
                   kv_format="fp8")
    q8 = KVLayout("m", torch.uint8, num_layers=2, block_size=4, num_kv_heads=2, head_dim=68, kv_format="q8_0")
    g = torch.Generator().manual_seed(3)
    k, v = (quantize_fp8(torch.randn(2, 4, 2, 64, generator=g)) for _ in range(2))
    tier = DiskTier(tmp_path, fp8, 10 * fp8.block_nbytes)
    assert tier.put(b"\x02" * 32, b"", (1, 2, 3, 4), k, v)
    block = DiskTier(tmp_path, fp8, 10 * fp8.block_nbytes).get(b"\x02" * 32)  # a restart finds it
    assert block.k.dtype == torch.float8_e4m3fn
    assert torch.equal(block.k.view(torch.uint8), k.view(torch.uint8))
    assert torch.equal(block.v.view(torch.uint8), v.view(torch.uint8))
    with pytest.raises(CorruptBlockError):  # the same bytes per block, another format: never read
        decode(bytearray(tier.path(b"\x02" * 32).read_bytes()), q8, b"\x02" * 32)
