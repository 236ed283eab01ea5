"""The encoders' native bias + GELU (kernels/cpu/src/encoder_gelu.c) against torch's exact (erf) GELU, and BertEncoder
using it for the feed-forward up projection beside native matmuls."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from edgeserve.kernels.cpu.encoder_gelu import bias_gelu_, gelu_library

pytestmark = pytest.mark.skipif(gelu_library() is None, reason="needs the native library's AVX-512 build")


@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 17), (64, 1536), (7, 40)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_torchs_erf_gelu(rows, cols, bias):
    gen = torch.Generator().manual_seed(rows * cols)
    y = torch.randn(rows, cols, generator=gen) * 4
    y[0, 0] = 0.0
    b = torch.randn(cols, generator=gen) if bias else None
    want = F.gelu((y + b if bias else y).double())
    assert bias_gelu_(y, b, gelu_library())
    # float64 GELU of the same float32 sums: torch's float32 GELU is up to 9e-7 off it, this kernel about as far
    torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=2e-6)


@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 17), (64, 4304)])
@pytest.mark.parametrize("bias", [False, True])
def test_tanh_form_matches_torchs_tanh_gelu(rows, cols, bias):
    gen = torch.Generator().manual_seed(rows + cols)
    y = torch.randn(rows, cols, generator=gen) * 4
    y[0, 0] = 0.0
    b = torch.randn(cols, generator=gen) if bias else None
    want = F.gelu((y + b if bias else y).double(), approximate="tanh")
    assert bias_gelu_(y, b, gelu_library(), tanh=True)
    torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=2e-6)
    extremes = torch.tensor([[-100.0, -12.0, -3.0, 0.5, 12.0, 100.0, -0.0, 1e-30]])
    want = F.gelu(extremes.double(), approximate="tanh")
    assert bias_gelu_(extremes, None, gelu_library(), tanh=True)
    torch.testing.assert_close(extremes.double(), want, rtol=1e-6, atol=2e-6)


def test_extremes_and_refusals():
    y = torch.tensor([[-100.0, -12.0, -3.0, 0.5, 12.0, 100.0, -0.0, 1e-30]])
    want = F.gelu(y.double())
    assert bias_gelu_(y, None, gelu_library())
    torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=2e-6)
    assert torch.isfinite(y).all()
    lib = gelu_library()
    assert not bias_gelu_(torch.zeros(2, 4, dtype=torch.float64), None, lib)  # not float32: left to torch
    assert not bias_gelu_(torch.zeros(4, 2).T, None, lib)  # not contiguous
    assert not bias_gelu_(torch.zeros(2, 4), torch.zeros(3), lib)  # a bias of the wrong width


def test_a_native_encoder_fuses_its_up_projections_bias_and_gelu(tmp_path, monkeypatch):
    from test_encoder_native import TEXTS, VOCAB, _bert_state, _load

    from encoder_gguf import write_encoder_gguf

    sd = _bert_state(64, 2, 128)
    gen = torch.Generator().manual_seed(0)
    sd = {k: torch.randn(v.shape, generator=gen) * 0.5 if k.endswith("intermediate.dense.bias") else v
          for k, v in sd.items()}  # (BERT's init leaves biases zero)
    path = write_encoder_gguf(tmp_path / "q8.gguf", "bert", sd, VOCAB, hidden=64, layers=2, heads=4, ffn=128,
                              context=128, pooling_type=1, qtype="Q8_0")
    lm = _load(path, monkeypatch, True)
    assert lm.model.gelu_lib is not None
    calls = []
    monkeypatch.setattr("edgeserve.models.encoders.bert.bias_gelu_", lambda *a: calls.append(1) or bias_gelu_(*a))
    seqs = [lm.encode(t)[0] for t in TEXTS]
    got = lm.embed(seqs).numpy()
    assert len(calls) == 2  # one per layer
    lm.model.gelu_lib = None  # torch's bias add and GELU, the same matmuls
    want = lm.embed(seqs).numpy()
    # (a GELU output a float32 step apart can move the next layer's int8 activation by one step: no elementwise bound)
    assert (got * want).sum(-1).min() > 0.99999
    np.testing.assert_allclose(got, want, atol=1e-3)
