"""Triton paged attention (decode and prefill) against the torch twin, in the interpreter on CPU or on a GPU."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICES, assert_close, kernel_device, paged_batch

from edgeserve.kernels import dispatch
from edgeserve.kernels.torch.paged_attention import paged_attention as twin

# (query_lens, seq_lens, block_size): decode-only, prefill-only, mixed; odd lengths and block-boundary ends
MIXES = {
    "decode": ([1, 1, 1, 1], [5, 16, 33, 1], 4),  # 16: exactly four blocks; 1: a first token
    "prefill": ([7, 20], [7, 37], 8),  # a fresh prompt; a chunk after a cached prefix of 17
    "prefill_boundary": ([16, 3], [32, 3], 16),  # ends exactly on a block boundary; a prompt shorter than a block
    "mixed": ([1, 9, 1, 4], [16, 9, 2, 21], 16),  # decodes and prefills in one flat batch
}
HEADS = {"mha": (4, 4), "gqa3": (6, 2), "gqa8": (8, 1)}


def run_case(device: str, mix: str, heads: str, head_dim: int, dtype: torch.dtype, seed: int = 0):
    query_lens, seq_lens, block_size = MIXES[mix]
    num_heads, num_kv_heads = HEADS[heads]
    k_cache, v_cache, meta = paged_batch(query_lens, seq_lens, block_size, num_kv_heads, head_dim, dtype, device, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype).to(device)
    with dispatch.force_backend("triton"):
        out = dispatch.paged_attention(q, k_cache, v_cache, meta)
    expected = twin(q.float().cpu(), k_cache.float().cpu(), v_cache.float().cpu(), meta_cpu(meta))
    assert out.dtype == dtype and out.device.type == device
    return out, expected


def meta_cpu(meta):
    """The same metadata with tensors on the CPU (the twin runs there)."""
    return dispatch.AttentionMetadata(meta.slot_mapping.cpu(), meta.query_start_loc.cpu(), meta.seq_lens.cpu(),
                                      meta.block_tables.cpu(), meta.max_query_len, meta.max_seq_len,
                                      meta.query_lens_host, meta.seq_lens_host)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("mix", list(MIXES))
def test_paged_attention_matches_twin_fp32(device, mix, heads, head_dim):
    device = kernel_device(device)
    out, expected = run_case(device, mix, heads, head_dim, torch.float32)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("mix,heads,head_dim", [("decode", "gqa8", 128), ("mixed", "gqa3", 64),
                                                ("prefill", "mha", 128)])
def test_paged_attention_half_dtypes(device, mix, heads, head_dim, dtype):
    device = kernel_device(device)
    out, expected = run_case(device, mix, heads, head_dim, dtype)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens_per_split", [16, 32, 256])
def test_decode_splits_agree(device, tokens_per_split):
    """Flash-decoding: any split size gives the same output, including splits past a short sequence's end."""

    device = kernel_device(device)
    # after the skip: a Triton kernel module needs triton to import
    from edgeserve.kernels.triton.decode_attention import paged_decode_attention
    k_cache, v_cache, meta = paged_batch([1, 1, 1], [3, 70, 48], 16, 2, 64, torch.float32, device, seed=3)
    q = torch.randn(3, 6, 64).to(device)
    out = paged_decode_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                 meta.max_seq_len, tokens_per_split=tokens_per_split)
    expected = twin(q.cpu(), k_cache.cpu(), v_cache.cpu(), meta_cpu(meta))
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [64, 80])
def test_odd_block_size_head_dim_and_scale(device, head_dim):
    """A block size that is not a power of two (tokens are gathered one by one), a head_dim that is not one
    either (masked to the next power of two), and an explicit scale."""
    device = kernel_device(device)
    k_cache, v_cache, meta = paged_batch([1, 5], [13, 18], 6, 1, head_dim, torch.float32, device, seed=5)
    q = torch.randn(6, 3, head_dim).to(device)
    with dispatch.force_backend("triton"):
        out = dispatch.paged_attention(q, k_cache, v_cache, meta, scale=0.3)
    expected = twin(q.cpu(), k_cache.cpu(), v_cache.cpu(), meta_cpu(meta), scale=0.3)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_attention_reads_through_block_table(device):
    """Changing a K/V block the table does not name leaves the output alone; changing a named one moves it."""
    device = kernel_device(device)
    k_cache, v_cache, meta = paged_batch([1, 1], [9, 5], 4, 2, 64, torch.float32, device, seed=7)
    q = torch.randn(2, 2, 64).to(device)
    with dispatch.force_backend("triton"):
        before = dispatch.paged_attention(q, k_cache, v_cache, meta)
        used = set(meta.block_tables[0, :3].tolist()) | set(meta.block_tables[1, :2].tolist())
        unused = next(b for b in range(k_cache.shape[0]) if b not in used)
        v_cache[unused] += 100.0
        assert torch.equal(dispatch.paged_attention(q, k_cache, v_cache, meta), before)
        v_cache[meta.block_tables[1, 1].item(), 0] += 100.0  # token 4 of sequence 1, inside its context
        after = dispatch.paged_attention(q, k_cache, v_cache, meta)
    assert torch.equal(after[0], before[0])
    assert (after[1] - before[1]).abs().max() > 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_decode_padding_sequence_gives_zeros(device):
    """A padding entry (seq_len 0, as in a decode batch padded to a CUDA-graph size) yields a zero row and leaves
    the real sequences' rows as the twin computes them."""
    device = kernel_device(device)
    k_cache, v_cache, meta = paged_batch([1, 1], [11, 20], 4, 2, 64, torch.float32, device, seed=11)
    padded = dispatch.AttentionMetadata.build([1, 1, 1], [11, 20, 0], [meta.block_tables[0, :3].tolist(),
                                              meta.block_tables[1, :5].tolist(), []],
                                              meta.slot_mapping.tolist() + [-1], device=device)
    q = torch.randn(3, 4, 64).to(device)
    with dispatch.force_backend("triton"):
        out = dispatch.paged_attention(q, k_cache, v_cache, padded)
    assert torch.equal(out[2].cpu(), torch.zeros(4, 64))
    assert_close(out[:2], twin(q[:2].cpu(), k_cache.cpu(), v_cache.cpu(), meta_cpu(meta)), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("window", [1, 5, 16])
def test_sliding_window_matches_twin(device, mix, window):
    """Sliding-window layers (Gemma): each row sees only its last `window` keys, in both kernels."""
    device = kernel_device(device)
    query_lens, seq_lens, block_size = MIXES[mix]
    k_cache, v_cache, meta = paged_batch(query_lens, seq_lens, block_size, 2, 64, torch.float32, device, 3)
    q = torch.randn(sum(query_lens), 6, 64, generator=torch.Generator().manual_seed(4)).to(device)
    with dispatch.force_backend("triton"):
        out = dispatch.paged_attention(q, k_cache, v_cache, meta, window=window)
    expected = twin(q.cpu(), k_cache.cpu(), v_cache.cpu(), meta_cpu(meta), window=window)
    assert_close(out, expected, torch.float32)
    full = twin(q.cpu(), k_cache.cpu(), v_cache.cpu(), meta_cpu(meta))
    if max(seq_lens) > window:
        assert (expected - full).abs().max() > 1e-3  # the window changes the result
