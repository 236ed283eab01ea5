"""M-RoPE (models/mrope.py): prompt positions with several images against transformers' get_rope_index, the
rotary pairs' axes against its cos/sin layouts, step rows past the prompt, and the config fields from GGUF keys."""

from __future__ import annotations

import pytest
import torch

from edgeserve.models.config import config_from_gguf
from edgeserve.models.mrope import mrope_axes, mrope_cos_sin, mrope_positions

transformers = pytest.importorskip("transformers")

PAD = 7  # the image placeholder id of the prompts below


def hf_positions(ids: list[int], grids: list[tuple[int, int, int]]):
    """transformers' Qwen3-VL positions and delta for a prompt with images of these (t, h, w) patch grids."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    model = Qwen3VLModel.__new__(Qwen3VLModel)  # get_rope_index reads only config.vision_config.spatial_merge_size
    model.config = transformers.Qwen3VLConfig(vision_config=dict(spatial_merge_size=2))
    input_ids = torch.tensor([ids])
    return model.get_rope_index(input_ids, (input_ids == PAD).int(), image_grid_thw=torch.tensor(grids))


def test_positions_with_two_images_match_transformers():
    grids = [(1, 4, 6), (1, 8, 2)]  # patches: 2x3 and 4x1 language-model tokens
    ids = [1, 2, 3] + [PAD] * 6 + [4, 5] + [PAD] * 4 + [6, 8, 9]
    want, delta = hf_positions(ids, grids)
    got = mrope_positions(len(ids), [(3, (1, 2, 3)), (11, (1, 4, 1))])
    assert torch.equal(got.prompt, want[:, 0]) and got.delta == int(delta)
    # past the prompt every axis is the index plus the delta; inside, the table
    rows = got.rows(len(ids) - 2, 4)
    assert torch.equal(rows[:, :2], got.prompt[:, -2:])
    assert torch.equal(rows[:, 2:], (torch.arange(len(ids), len(ids) + 2) + got.delta).expand(3, 2))
    assert got.is_flat(0, 3) and not got.is_flat(2, 3) and got.is_flat(len(ids), 5)


def test_overlapping_images_are_refused():
    with pytest.raises(ValueError, match="overlap"):
        mrope_positions(20, [(2, (1, 2, 2)), (4, (1, 1, 2))])


@pytest.mark.parametrize("interleaved", [True, False])
def test_pair_axes_match_transformers_layouts(interleaved):
    """Each rotary pair turns by the axis transformers gives it (Qwen3-VL interleaved, Qwen2.5-VL in runs)."""
    head_dim, sections = 16, [2, 3, 3]
    positions = torch.tensor([[5, 5, 9], [5, 6, 1], [5, 7, 4]])  # [3, T]: distinct axes, so a wrong pick shows
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = positions[..., None].float() * inv_freq  # [3, T, pairs]
    if interleaved:
        want = freqs[0].clone()
        for dim, offset in ((1, 1), (2, 2)):
            idx = slice(offset, sections[dim] * 3, 3)
            want[..., idx] = freqs[dim, ..., idx]
    else:
        want = torch.cat([freqs[i % 3][..., chunk] for i, chunk in
                          enumerate(torch.arange(head_dim // 2).split(sections))], dim=-1)
    table = torch.outer(torch.arange(16).float(), inv_freq)
    cos, sin = mrope_cos_sin(table.cos(), table.sin(), positions, mrope_axes(head_dim, sections, interleaved))
    torch.testing.assert_close(cos, want.cos())
    torch.testing.assert_close(sin, want.sin())


@pytest.mark.parametrize("arch", ["qwen3vl", "qwen2vl"])
def test_gguf_keys_give_the_mrope_fields(arch):
    meta = {"general.architecture": arch, f"{arch}.block_count": 2, f"{arch}.embedding_length": 64,
            f"{arch}.feed_forward_length": 128, f"{arch}.attention.head_count": 4,
            f"{arch}.attention.head_count_kv": 2, f"{arch}.context_length": 256, f"{arch}.vocab_size": 100,
            f"{arch}.rope.dimension_sections": [2, 3, 3, 0]}
    names = {"blk.0.attn_q.bias"} if arch == "qwen2vl" else {"blk.0.attn_q_norm.weight"}
    config = config_from_gguf(meta, names | {"output.weight"})
    assert config.mrope_sections == (2, 3, 3)
    assert config.mrope_interleaved == (arch == "qwen3vl")
    assert config.attention_bias == (arch == "qwen2vl") and config.qk_norm == (arch == "qwen3vl")
