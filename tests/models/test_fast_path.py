"""The CPU fast path (4-bit packed / int8 weights, bf16 compute) stays close to exact float32 dequantization."""

from __future__ import annotations

import pytest

from tiny_gguf import write_tiny_llama


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "F16"])
def test_quantized_tiny_model_fast_path_matches_float32(tmp_path, qtype):
    """Packed 4-bit / int8 weights in bf16 give nearly the float32 (exactly dequantized) logits."""
    import torch

    from edgeserve.models.attention import ContiguousKV
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    path = write_tiny_llama(tmp_path / f"{qtype}.gguf", qtype=qtype, hidden=64, ffn=128)
    exact, fast = (load_model(resolve(str(path)), dtype=d) for d in ("float32", "auto"))
    ids = torch.arange(3, 40)
    outs = []
    for lm in (exact, fast):
        c = lm.config
        kv = ContiguousKV(c.num_layers, len(ids), c.num_kv_heads, c.head_dim, lm.model.dtype)
        outs.append(lm.model.logits(lm.model.forward(ids, torch.arange(len(ids)), kv)))
    # bf16 rounding on a random (chaotic) model moves logits by ~5% on average whatever the storage type;
    # a wrong packing, scale or offset moves them by about their own size
    assert (outs[0] - outs[1]).abs().mean() < 0.1 * outs[0].abs().mean()
    tv = 0.5 * (outs[0].softmax(-1) - outs[1].softmax(-1)).abs().sum(-1)
    assert tv.max() < 0.2
