"""A tiny GGUF per block format through the whole model on the native CPU kernels: its logits stay as close to
the exact float32 path (weights dequantized) as the torch bfloat16 path's are, and with EDGESERVE_NATIVE=0 the
torch path runs instead."""

from __future__ import annotations

import pytest
import torch
from tiny_gguf import write_tiny_llama

from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.cpu.native import BlockWeight
from edgeserve.loaders.dequant import SUPPORTED_QTYPES
from edgeserve.models.attention import ContiguousKV
from edgeserve.models.load import load_model
from edgeserve.registry import resolve

FORMATS = [q for q in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4")
           if q in SUPPORTED_QTYPES]
PROMPT = torch.tensor([5, 80, 120, 7, 99, 200, 31, 64, 150, 3, 17])


def logits(model) -> torch.Tensor:
    c = model.config
    kv = ContiguousKV(c.num_layers, 32, c.num_kv_heads, c.head_dim, model.dtype)
    hidden = model.forward(PROMPT, torch.arange(len(PROMPT)), kv)
    return model.logits(hidden).double()


@pytest.fixture(autouse=True)
def _native_on(monkeypatch):
    monkeypatch.delenv("EDGESERVE_NATIVE", raising=False)
    monkeypatch.setenv("EDGESERVE_THREADS", "2")


@pytest.mark.skipif(not cpu_native.available(), reason="no native CPU kernels here")
@pytest.mark.parametrize("qtype", FORMATS)
def test_native_model_close_to_float32_path(tmp_path, monkeypatch, qtype):
    path = write_tiny_llama(tmp_path / f"{qtype}.gguf", hidden=256, heads=4, kv_heads=2, ffn=512, qtype=qtype)
    native = load_model(resolve(str(path)), dtype="bfloat16").model
    assert isinstance(native.layers[0].qkv, BlockWeight) and isinstance(native.embed, BlockWeight)
    exact = load_model(resolve(str(path)), dtype="float32").model
    assert isinstance(exact.layers[0].qkv, torch.Tensor)
    monkeypatch.setenv("EDGESERVE_NATIVE", "0")
    torch_bf16 = load_model(resolve(str(path)), dtype="bfloat16").model
    got, want, baseline = logits(native), logits(exact), logits(torch_bf16)
    rel = ((got - want).norm() / want.norm()).item()
    # this random model amplifies rounding (bf16 alone moves its logits by several percent)
    assert rel < max(0.03, 1.5 * ((baseline - want).norm() / want.norm()).item()), rel
    # the greedy choice agrees wherever the float32 path is not close to a tie
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1 * want.std()
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_fallback_without_native_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESERVE_NATIVE", "0")
    path = write_tiny_llama(tmp_path / "q4k.gguf", hidden=256, heads=4, kv_heads=2, ffn=512, qtype="Q4_K")
    model = load_model(resolve(str(path)), dtype="bfloat16").model
    assert not isinstance(model.layers[0].qkv, BlockWeight)
    assert torch.isfinite(logits(model)).all()
