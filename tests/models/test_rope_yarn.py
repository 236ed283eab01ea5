"""YaRN RoPE scaling: inverse frequencies and cos/sin against transformers' computation, from an HF config and from
GGUF metadata."""

from __future__ import annotations

import pytest
import torch

from edgeserve.errors import ModelLoadError
from edgeserve.kernels.torch.rope import rope_attention_factor, rope_cos_sin, rope_inv_freq
from edgeserve.models.config import RopeScaling, config_from_gguf, config_from_hf


def hf_yarn(rope_parameters: dict, head_dim: int = 64, theta: float = 150000.0):
    """transformers' YaRN inverse frequencies and attention factor for a gpt-oss config with these parameters."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = GptOssConfig(num_hidden_layers=2, hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                       rope_parameters={**rope_parameters, "rope_theta": theta})
    return ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")


GPT_OSS = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
           "original_max_position_embeddings": 4096}


@pytest.mark.parametrize("params", [
    GPT_OSS,  # gpt-oss's own (no rounding of the ramp's ends)
    {**GPT_OSS, "truncate": True, "factor": 8.0},  # the rounded ramp other YaRN models use
    {**GPT_OSS, "attention_factor": 1.3, "beta_fast": 16.0, "beta_slow": 2.0},
])
def test_inv_freq_and_cos_sin_match_transformers(params):
    hf_cfg = {"model_type": "llama", "vocab_size": 64, "hidden_size": 256, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
              "rope_parameters": {**params, "rope_theta": 150000.0}}
    config = config_from_hf(hf_cfg)
    assert config.rope_scaling is not None and config.rope_scaling.kind == "yarn"
    inv = rope_inv_freq(64, 150000.0, config.rope_scaling)
    expected_inv, expected_factor = hf_yarn(params)
    torch.testing.assert_close(inv, expected_inv, rtol=1e-6, atol=0)
    factor = rope_attention_factor(config.rope_scaling)
    assert factor == pytest.approx(expected_factor)
    cos, sin = rope_cos_sin(inv, 5000, factor)
    pos = torch.arange(5000, dtype=torch.float32)[:, None]
    torch.testing.assert_close(cos, (pos * expected_inv).cos() * expected_factor)
    torch.testing.assert_close(sin, (pos * expected_inv).sin() * expected_factor)
    plain = rope_inv_freq(64, 150000.0, None)
    assert (inv - plain).abs().max() > 1e-4  # the scaling changes the low frequencies
    assert torch.equal(inv[:4], plain[:4])  # and keeps the fastest ones


def test_gguf_yarn_metadata():
    meta = {"general.architecture": "gpt-oss", "gpt-oss.rope.scaling.type": "yarn", "gpt-oss.rope.scaling.factor": 32.0,
            "gpt-oss.rope.scaling.original_context_length": 4096}
    from edgeserve.models.config import _yarn_from_gguf

    scaling = _yarn_from_gguf("gpt-oss", meta)
    assert scaling == RopeScaling("yarn", factor=32.0, original_max_position_embeddings=4096, truncate=False)
    inv = rope_inv_freq(64, 150000.0, scaling)
    torch.testing.assert_close(inv, hf_yarn(GPT_OSS)[0], rtol=1e-6, atol=0)
    with pytest.raises(ModelLoadError, match="original_context_length"):
        _yarn_from_gguf("gpt-oss", {"gpt-oss.rope.scaling.factor": 32.0})


def test_gguf_config_reads_yarn():
    meta = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.attention.head_count": 4,
            "llama.block_count": 1, "llama.feed_forward_length": 128, "llama.vocab_size": 10,
            "llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
            "llama.rope.scaling.original_context_length": 2048, "llama.rope.scaling.yarn_beta_fast": 16.0}
    scaling = config_from_gguf(meta, {"output.weight"}).rope_scaling
    assert scaling == RopeScaling("yarn", factor=4.0, original_max_position_embeddings=2048, beta_fast=16.0)
