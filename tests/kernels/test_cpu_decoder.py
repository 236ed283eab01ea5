"""The fused native decoder stack (kernels/cpu/src/layer.c through kernels.cpu.decoder): one native call per step gives
the same hidden states and the same K/V pool contents, bit for bit, as the per-op path, for a decode batch of 1
and of 3 sequences with different context lengths and for prompt chunks mixed with decodes."""

from __future__ import annotations

import pytest
import torch
from tiny_gguf import write_tiny_llama

from edgeserve.engine.cache.kv_cache import KVPool, PagedKVAttention
from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.cpu.decoder import NativeDecoder
from edgeserve.kernels.torch.paged_attention import AttentionMetadata
from edgeserve.models.load import load_model
from edgeserve.registry import resolve

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no native CPU kernels here")
BLOCK = 16


@pytest.fixture(autouse=True)
def _native_on(monkeypatch):
    monkeypatch.delenv("EDGESERVE_NATIVE", raising=False)
    monkeypatch.delenv("EDGESERVE_KERNELS", raising=False)
    monkeypatch.setenv("EDGESERVE_THREADS", "2")


def tiny_model(tmp_path, qtype: str, seed: int = 0):
    path = write_tiny_llama(tmp_path / f"{qtype}.gguf", hidden=256, layers=3, heads=4, kv_heads=2, ffn=512,
                            qtype=qtype, seed=seed)
    return load_model(resolve(str(path)), dtype="bfloat16").model


def run_steps(model, fused: bool, steps: list[list[tuple[int, int]]], kv=None):
    """Run `steps` (each a list of (sequence, new tokens)) over a fresh pool (of KV format `kv`, default the
    model's dtype); the hidden states of every step and the final pool. Sequence i owns blocks 4i..4i+3; token ids
    and positions follow from what came before."""
    model._native = False if fused else None  # False: plan on the next forward; None: the per-op path
    pool = KVPool(model.config, 16, BLOCK, model.dtype if kv is None else kv)
    lengths: dict[int, int] = {}
    hidden = []
    for step in steps:
        ids, positions, slots, query_lens, seq_lens, tables = [], [], [], [], [], []
        for seq, n in step:
            start = lengths.get(seq, 0)
            table = [4 * seq + j for j in range(4)]
            for p in range(start, start + n):
                ids.append((seq * 37 + p * 11) % (model.config.vocab_size - 3) + 3)
                positions.append(p)
                slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
            lengths[seq] = start + n
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(table)
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, slots)
        hidden.append(model.forward(torch.tensor(ids), torch.tensor(positions), PagedKVAttention(pool, meta)))
    assert (model._native is not None) == fused
    return hidden, pool


# prompts of 5, 23 and 40 tokens (the last one in two chunks, next to decodes), then decodes of batch 3 and 1
STEPS = [[(0, 5), (1, 23), (2, 17)], [(0, 1), (1, 1), (2, 23)], [(0, 1), (1, 1), (2, 1)], [(1, 1)], [(0, 1), (2, 1)]]


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K", "Q8_0"])
def test_fused_stack_equals_the_per_op_path(tmp_path, qtype):
    model = tiny_model(tmp_path, qtype)
    assert isinstance(model.native_decoder(), NativeDecoder)
    fused, fused_pool = run_steps(model, True, STEPS)
    per_op, per_op_pool = run_steps(model, False, STEPS)
    for step, (a, b) in enumerate(zip(fused, per_op)):
        assert a.dtype == b.dtype == model.dtype
        assert torch.equal(a, b), f"step {step}: max diff {(a.float() - b.float()).abs().max().item()}"
    assert torch.equal(fused_pool.k, per_op_pool.k) and torch.equal(fused_pool.v, per_op_pool.v)


def test_fused_stack_equals_the_per_op_path_over_a_q8_0_pool(tmp_path):
    from edgeserve.engine.cache.kv_format import Q8_0

    model = tiny_model(tmp_path, "Q4_1")
    fused, fused_pool = run_steps(model, True, STEPS, kv=Q8_0)
    per_op, per_op_pool = run_steps(model, False, STEPS, kv=Q8_0)
    assert fused_pool.k.dtype == torch.uint8 and fused_pool.k.shape[-1] == 64 // 32 * 34
    for step, (a, b) in enumerate(zip(fused, per_op)):
        assert torch.equal(a, b), f"step {step}: max diff {(a.float() - b.float()).abs().max().item()}"
    assert torch.equal(fused_pool.k, per_op_pool.k) and torch.equal(fused_pool.v, per_op_pool.v)
    bf16, _ = run_steps(model, True, STEPS)
    assert not torch.equal(bf16[-1], fused[-1])  # the q8_0 pool is what the stack read
    assert torch.nn.functional.cosine_similarity(bf16[-1].float(), fused[-1].float()).min() > 0.99


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0"])
def test_fused_stack_equals_the_per_op_path_over_an_f16_pool(tmp_path, qtype):
    """The CPU's default KV cache beside bf16 compute (float16 K/V, float32 queries and attention outputs): the
    fused stack gives the per-op path's bits and pool; it is what the stack read (not the bf16 pool's result), and
    the pool holds the float32 K rounded to float16, much closer to it than a bf16 pool's."""
    from edgeserve.engine.cache.kv_format import resolve_kv_format

    model = tiny_model(tmp_path, qtype)
    f16 = resolve_kv_format("auto", model.config, model.dtype, "cpu")
    assert f16.storage == torch.float16
    fused, fused_pool = run_steps(model, True, STEPS, kv=f16)
    per_op, per_op_pool = run_steps(model, False, STEPS, kv=f16)
    for step, (a, b) in enumerate(zip(fused, per_op)):
        assert a.dtype == b.dtype == model.dtype
        assert torch.equal(a, b), f"step {step}: max diff {(a.float() - b.float()).abs().max().item()}"
    assert torch.equal(fused_pool.k, per_op_pool.k) and torch.equal(fused_pool.v, per_op_pool.v)
    bf16, bf16_pool = run_steps(model, True, STEPS, kv=torch.bfloat16)
    assert not torch.equal(bf16[-1], fused[-1])
    f32, f32_pool = run_steps(model, True, STEPS, kv=torch.float32)
    # layer 0's K (the same float32 values on every run, before any attention): rounded to float16 it is 8x closer
    err = {name: (p.k[0].float() - f32_pool.k[0]).abs().mean() for name, p in (("f16", fused_pool), ("bf16", bf16_pool))}
    assert 0 < err["f16"] < err["bf16"] / 4, err


def test_fused_stack_with_a_qkv_bias(tmp_path):
    model = tiny_model(tmp_path, "Q4_0", seed=3)
    gen = torch.Generator().manual_seed(0)
    for layer in model.layers:  # what a qwen2 file has: a bias on q, k and v, kept in the compute dtype
        layer.qkv_bias = torch.randn(layer.qkv.out_features, generator=gen).to(model.dtype)
    fused, _ = run_steps(model, True, STEPS[:3])
    per_op, _ = run_steps(model, False, STEPS[:3])
    assert all(torch.equal(a, b) for a, b in zip(fused, per_op))


def test_a_rows_result_does_not_depend_on_its_batch(tmp_path):
    model = tiny_model(tmp_path, "Q4_K")
    together, _ = run_steps(model, True, [[(0, 9), (1, 30)], [(0, 1), (1, 1)]])
    alone, _ = run_steps(model, True, [[(1, 30)], [(1, 1)]])
    assert torch.equal(together[1][1], alone[1][0])


def test_fused_stack_with_qk_norms(tmp_path):
    """Qwen3's per-head RMSNorm of q and k before RoPE, in the stack as in the per-op path."""
    model = tiny_model(tmp_path, "Q8_0", seed=5)
    gen = torch.Generator().manual_seed(1)
    for layer in model.layers:
        layer.q_norm = torch.rand(model.config.head_dim, generator=gen) + 0.5
        layer.k_norm = torch.rand(model.config.head_dim, generator=gen) + 0.5
    assert isinstance(model.native_decoder(), NativeDecoder)
    fused, fused_pool = run_steps(model, True, STEPS[:3])
    per_op, per_op_pool = run_steps(model, False, STEPS[:3])
    assert all(torch.equal(a, b) for a, b in zip(fused, per_op))
    assert torch.equal(fused_pool.k, per_op_pool.k)
    plain, _ = run_steps(tiny_model(tmp_path, "Q8_0", seed=5), True, STEPS[:1])
    assert not torch.equal(plain[0], fused[0])  # the norms did something


def test_models_the_stack_does_not_take_keep_the_per_op_path(tmp_path, monkeypatch):
    import dataclasses

    model = tiny_model(tmp_path, "Q4_K")
    model.config = dataclasses.replace(model.config, attn_softcap=30.0)  # soft-capping is not in the native stack
    assert NativeDecoder.build(model) is None
    monkeypatch.setenv("EDGESERVE_NATIVE", "0")
    f32 = load_model(resolve(str(tmp_path / "Q4_K.gguf")), dtype="float32").model
    assert NativeDecoder.build(f32) is None
