"""The encoders' native attention (kernels/cpu/src/encoder_attention.c) against torch's scaled_dot_product_attention
under the same right-padding mask, batch invariance, and BertEncoder's use of it beside native matmuls."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from edgeserve.kernels.cpu.encoder_attention import attention_library, encoder_attention

pytestmark = pytest.mark.skipif(attention_library(32) is None, reason="needs the native library's AVX-512 build")


def _sdpa(q, k, v, lengths, heads):
    b, t, width = q.shape
    mask = torch.zeros(b, 1, 1, t)
    for i, n in enumerate(lengths.tolist()):
        mask[i, ..., n:] = float("-inf")
    split = [y.view(b, t, heads, width // heads).transpose(1, 2) for y in (q, k, v)]
    return F.scaled_dot_product_attention(*split, attn_mask=mask).transpose(1, 2).reshape(b, t, width)


@pytest.mark.parametrize("d", [32, 64, 72])
@pytest.mark.parametrize("lengths", [[1], [17], [64, 40, 3], [130, 129], [600, 257]])  # 600: keys in 3 blocks
def test_matches_torch_attention_under_the_padding_mask(d, lengths):
    gen = torch.Generator().manual_seed(len(lengths) * 100 + d)
    b, t, heads = len(lengths), max(lengths), 3
    q, k, v = (torch.randn(b, t, heads * d, generator=gen) * 2 for _ in range(3))
    lens = torch.tensor(lengths)
    got = encoder_attention(q, k, v, lens, heads, attention_library(d))
    want = _sdpa(q, k, v, lens, heads)
    for i, n in enumerate(lengths):  # rows past a sequence's length are unused
        torch.testing.assert_close(got[i, :n], want[i, :n], rtol=1e-5, atol=1e-5)


def test_a_sequence_gets_the_same_bits_alone_and_in_a_padded_batch():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, 50, 4 * 32, generator=gen) for _ in range(3))
    lens = torch.tensor([50, 21, 33])
    lib = attention_library(32)
    batched = encoder_attention(q, k, v, lens, 4, lib)
    alone = encoder_attention(*(y[1:2, :21].contiguous() for y in (q, k, v)), lens[1:2], 4, lib)
    assert torch.equal(alone[0], batched[1, :21])


def test_strided_views_of_a_fused_projection_are_taken_and_other_inputs_refused():
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(2, 9, 3 * 64, generator=gen)
    q, k, v = qkv[..., :64], qkv[..., 64:128], qkv[..., 128:]
    lens = torch.tensor([9, 4])
    got = encoder_attention(q, k, v, lens, 2, attention_library(32))
    want = _sdpa(q.contiguous(), k.contiguous(), v.contiguous(), lens, 2)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    wide = torch.full((2, 9, 128), 7.0)  # into some columns of a wider buffer, the others untouched
    assert encoder_attention(q, k, v, lens, 2, attention_library(32), out=wide[..., 64:]) is not None
    torch.testing.assert_close(wide[0, :, 64:], want[0], rtol=1e-5, atol=1e-5)
    assert (wide[..., :64] == 7.0).all()
    assert encoder_attention(q.double(), k, v, lens, 2, attention_library(32)) is None  # not float32
    assert encoder_attention(q, k, v, lens, 4, attention_library(32)) is not None  # head size 16: a multiple of 8
    assert encoder_attention(q[..., :60], k[..., :60], v[..., :60], lens, 5, attention_library(32)) is None  # 12
    with pytest.raises(ValueError, match="lengths"):
        encoder_attention(q, k, v, torch.tensor([9, 0]), 2, attention_library(32))


def test_a_native_encoder_attends_natively_with_torchs_results(tmp_path, monkeypatch):
    from test_encoder_native import TEXTS, VOCAB, _bert_state, _load

    from edgeserve.models.encoders.bert import pad_batch
    from encoder_gguf import write_encoder_gguf

    path = write_encoder_gguf(tmp_path / "q8.gguf", "bert", _bert_state(128, 2, 256), VOCAB, hidden=128, layers=2,
                              heads=4, ffn=256, context=128, pooling_type=1, qtype="Q8_0")
    lm = _load(path, monkeypatch, True)
    assert lm.model.attn_lib is not None
    calls = []
    native = encoder_attention
    monkeypatch.setattr("edgeserve.models.encoders.bert.encoder_attention", lambda *a: calls.append(1) or native(*a))
    ids, mask = pad_batch([lm.encode(t)[0] for t in TEXTS])
    got = lm.model(ids, mask)
    assert len(calls) == 2  # one per layer
    lm.model.attn_lib = None  # torch's attention, the same matmuls
    want = lm.model(ids, mask)
    keep = mask.bool()
    np.testing.assert_allclose(got[keep].numpy(), want[keep].numpy(), rtol=1e-4, atol=1e-4)
