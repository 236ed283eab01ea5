"""Each supported architecture matches transformers' implementation on a tiny random model."""

from __future__ import annotations

import pytest
import torch
import transformers

from edgeserve.errors import UnsupportedModelError
from edgeserve.loaders.hf_folder import HFFolder
from edgeserve.models.attention import ContiguousKV
from edgeserve.models.config import config_from_hf
from edgeserve.models.llama import LlamaModel


SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=256, rms_norm_eps=1e-5)


def make_folder(tmp_path, config) -> "transformers.PreTrainedModel":
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    for p in model.parameters():  # random init is too tame around 0 for norms and biases; spread them
        p.data.normal_(0, 0.2) if p.dim() == 1 else None
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model


CASES = {
    "llama-gqa": lambda: transformers.LlamaConfig(**SHAPE, num_key_value_heads=2, rope_theta=10000.0),
    "llama-tied-mha": lambda: transformers.LlamaConfig(**SHAPE, num_key_value_heads=4, tie_word_embeddings=True),
    "llama3-rope-scaling": lambda: transformers.LlamaConfig(
        **SHAPE, num_key_value_heads=1, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32}),
    "mistral": lambda: transformers.MistralConfig(**SHAPE, num_key_value_heads=2, sliding_window=None),
    "qwen2-bias": lambda: transformers.Qwen2Config(**SHAPE, num_key_value_heads=2),
    "qwen3-qknorm-headdim": lambda: transformers.Qwen3Config(**SHAPE, num_key_value_heads=2, head_dim=32),
}


@pytest.mark.parametrize("case", list(CASES))
def test_architecture_matches_transformers(tmp_path, case):
    ref = make_folder(tmp_path, CASES[case]())
    folder = HFFolder(tmp_path)
    config = config_from_hf(folder.config)
    model = LlamaModel.from_weights(config, folder.weights(), dtype=torch.float32)
    ids = torch.randint(0, SHAPE["vocab_size"], (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    # prefill 30 tokens, then 10 single-token decode steps: the cache path must agree with full attention
    kv = ContiguousKV(config.num_layers, 64, config.num_kv_heads, config.head_dim, torch.float32)
    got = [model.logits(model.forward(ids[:30], torch.arange(30), kv))]
    kv.advance(30)
    for i in range(30, 40):
        got.append(model.logits(model.forward(ids[i:i + 1], torch.tensor([i]), kv)))
        kv.advance(1)
    got_t = torch.cat(got)
    assert expected.abs().max() > 0.1  # a model that does something
    torch.testing.assert_close(got_t, expected, atol=2e-4, rtol=2e-4)


def test_config_reads_architecture_specifics():
    q2 = config_from_hf(transformers.Qwen2Config(**SHAPE, num_key_value_heads=2).to_dict())
    q3 = config_from_hf(transformers.Qwen3Config(**SHAPE, num_key_value_heads=2, head_dim=32).to_dict())
    assert q2.attention_bias and not q2.qk_norm
    assert q3.qk_norm and q3.head_dim == 32 and q3.num_kv_heads == 2


def test_unsupported_architecture_refused_by_name():
    cfg = transformers.GPT2Config().to_dict()
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        config_from_hf(cfg)
