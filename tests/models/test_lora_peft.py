"""A PEFT LoRA adapter gives the logits of transformers + peft in float32 (peft is in the test extra)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from edgeserve.loaders.hf_folder import HFFolder  # noqa: E402
from edgeserve.models.attention import ContiguousKV  # noqa: E402
from edgeserve.models.config import config_from_hf  # noqa: E402
from edgeserve.models.llama import LlamaModel  # noqa: E402
from edgeserve.models.lora import load_adapter  # noqa: E402
from edgeserve.models.lora_step import StepLora  # noqa: E402

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("targets,rslora", [(ALL, False), (["q_proj", "v_proj", "down_proj"], True)])
def test_a_peft_adapter_matches_transformers_and_peft(tmp_path, targets, rslora):
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).eval()
    base.save_pretrained(tmp_path / "base", safe_serialization=True)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                                                     use_rslora=rslora))
    for name, p in lora.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: give the adapter something to do
            p.data.normal_(0, 0.1)
    lora.save_pretrained(tmp_path / "adapter")
    ids = torch.randint(0, SHAPE["vocab_size"], (24,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = lora(ids[None]).logits[0]
        with lora.disable_adapter():
            plain = lora(ids[None]).logits[0]
    folder = HFFolder(tmp_path / "base")
    config = config_from_hf(folder.config)
    model = LlamaModel.from_weights(config, folder.weights(), dtype=torch.float32)
    adapter = load_adapter("a", tmp_path / "adapter", config)
    kv = ContiguousKV(config.num_layers, 64, config.num_kv_heads, config.head_dim, torch.float32)
    got = model.logits(model.forward(ids, torch.arange(24), kv, lora=StepLora.build([(adapter, 1.0)], [24])))
    assert (expected - plain).abs().max() > 0.01  # the adapter changes the logits
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)
