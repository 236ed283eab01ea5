"""The dispatch functions are drop-ins for the decoder's kernel calls: a tiny Q4_0 Llama run with W4A16 weights
repacked from its GGUF blocks, Triton RMSNorm / SiLU-and-mul / W4A16 matmul and Triton paged attention over a
ragged batch (one sequence decoding while another prefills) gives the logits of the torch twins running each
sequence alone through the contiguous cache. The `PagedKV` adapter below is a sketch of the engine's wiring."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import kernel_device
from tiny_gguf import write_tiny_llama

from edgeserve.kernels import dispatch
from edgeserve.kernels.formats.quant_linear import Q4Blocks

BLOCK = 4


class PagedKV:
    """A KVAttention over a paged pool: writes this step's K/V at `meta.slot_mapping`, attends through the tables."""

    def __init__(self, layers: int, num_blocks: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: str):
        shape = (layers, num_blocks, BLOCK, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.meta: dispatch.AttentionMetadata | None = None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        assert self.meta is not None
        dispatch.write_kv(self.k[layer], self.v[layer], k, v, self.meta.slot_mapping)
        return dispatch.paged_attention(q, self.k[layer], self.v[layer], self.meta).reshape(q.shape[0], -1)


def w4a16_model(path):
    """The tiny model in float32 with every layer matrix replaced by its W4A16 repack of the GGUF's Q4_0 blocks."""
    from edgeserve.loaders.gguf_file import GGUFFile
    from edgeserve.loaders.gguf_weights import GGUFWeights
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    lm = load_model(resolve(str(path)), dtype="float32")
    c = lm.config
    source = GGUFWeights(GGUFFile(path), c.num_heads, c.num_kv_heads)

    def packed(names: list[str]) -> dispatch.W4A16Weight:
        parts = [source.get(n, keep_int4=True) for n in names]
        assert all(isinstance(p, Q4Blocks) for p in parts)
        return dispatch.repack_q4(Q4Blocks.cat(parts), torch.float32)

    for i, layer in enumerate(lm.model.layers):
        p = f"model.layers.{i}."
        layer.qkv = packed([p + f"self_attn.{x}_proj.weight" for x in "qkv"])
        layer.o_proj = packed([p + "self_attn.o_proj.weight"])
        layer.gate_up = packed([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
        layer.down = packed([p + "mlp.down_proj.weight"])
    return lm.model


@pytest.mark.parametrize("device", ["cpu"])
def test_tiny_model_through_triton_kernels_matches_twins(tmp_path, monkeypatch, device):
    from edgeserve.models import llama
    from edgeserve.models.attention import ContiguousKV

    device = kernel_device(device)
    model = w4a16_model(write_tiny_llama(tmp_path / "q4.gguf", qtype="Q4_0", hidden=64, ffn=128, heads=4, kv_heads=2))
    c = model.config
    for name in ("linear", "rms_norm", "silu_and_mul"):  # what the engine's wiring will do in llama.py
        monkeypatch.setattr(llama, name, getattr(dispatch, name))
    a_ids, b_ids = torch.arange(3, 17), torch.arange(40, 49)  # 14 and 9 tokens

    # reference: torch twins, each sequence alone in a contiguous cache (A: 13-token prefill then one decode)
    with dispatch.force_backend("torch"):
        ref = {}
        for key, ids, split in (("a", a_ids, 13), ("b", b_ids, 9)):
            kv = ContiguousKV(c.num_layers, 32, c.num_kv_heads, c.head_dim, torch.float32)
            first = model.logits(model.forward(ids[:split], torch.arange(split), kv))
            kv.advance(split)
            rest = [model.logits(model.forward(ids[split:], torch.arange(split, len(ids)), kv))] if split < len(ids) else []
            ref[key] = torch.cat([first, *rest])

    # Triton: step 1 prefills A's 13 tokens; step 2 decodes A's 14th token while B prefills its 9
    kv = PagedKV(c.num_layers, 12, c.num_kv_heads, c.head_dim, torch.float32, device)
    table_a, table_b = [7, 2, 9, 4], [1, 11, 5]
    slot = lambda table, pos: table[pos // BLOCK] * BLOCK + pos % BLOCK  # noqa: E731
    with dispatch.force_backend("triton"):
        kv.meta = dispatch.AttentionMetadata.build([13], [13], [table_a], [slot(table_a, p) for p in range(13)])
        step1 = model.logits(model.forward(a_ids[:13], torch.arange(13), kv))
        kv.meta = dispatch.AttentionMetadata.build([1, 9], [14, 9], [table_a, table_b],
                                                   [slot(table_a, 13)] + [slot(table_b, p) for p in range(9)])
        ids = torch.cat([a_ids[13:], b_ids])
        positions = torch.cat([torch.tensor([13]), torch.arange(9)])
        step2 = model.logits(model.forward(ids, positions, kv))

    got_a = torch.cat([step1, step2[:1]])
    assert ref["a"].abs().max() > 0.5  # a model that does something
    torch.testing.assert_close(got_a, ref["a"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(step2[1:], ref["b"], atol=1e-4, rtol=1e-4)
