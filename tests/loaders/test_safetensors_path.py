"""The default model converted to a Hugging Face folder (fp16 safetensors) loads and generates like the GGUF."""

from __future__ import annotations

import json

import pytest
import torch

from edgeserve.llm import LLM
from edgeserve.errors import ModelLoadError
from edgeserve.models.load import load_model
from edgeserve.registry import resolve
from edgeserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def hf_folder(default_model_hf_fp16):
    """transformers' conversion of the GGUF: dequantized fp16 safetensors, config.json, tokenizer files."""
    return default_model_hf_fp16


def test_hf_folder_greedy_matches_gguf(hf_folder, default_model_fp32):
    assert list(hf_folder.glob("*.safetensors")) and (hf_folder / "tokenizer.json").exists()
    lm_hf = load_model(resolve(str(hf_folder)), dtype="float32")
    lm = default_model_fp32
    assert lm_hf.config.num_layers == lm.config.num_layers and lm_hf.config.tie_word_embeddings
    for prompt in ["Name three primary colors.", "Explain recursion in one sentence."]:
        msgs = [{"role": "user", "content": prompt}]
        text = lm.chat_template.render(msgs)
        assert lm_hf.chat_template.render(msgs) == text
        ids = lm.tokenizer.encode(text, add_special_tokens=False)
        assert lm_hf.tokenizer.encode(text, add_special_tokens=False) == ids
        params = SamplingParams(temperature=0.0, max_tokens=32)
        a = LLM.from_model(lm, kv_cache_gb=0.05).generate([ids], params)[0].outputs[0].token_ids
        b = LLM.from_model(lm_hf, kv_cache_gb=0.05).generate([ids], params)[0].outputs[0].token_ids
        assert a == b


def test_sharded_folder_loads(hf_folder, tmp_path):
    """A sharded checkpoint (index + two files) gives the same tensors as the single file."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(next(hf_folder.glob("*.safetensors"))))
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in keys}, str(tmp_path / fname))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"]:
        (tmp_path / f).write_bytes((hf_folder / f).read_bytes())
    lm = load_model(resolve(str(tmp_path)), dtype="float32")
    ref = load_model(resolve(str(hf_folder)), dtype="float32")
    assert torch.equal(lm.model.embed, ref.model.embed)
    assert torch.equal(lm.model.layers[-1].down, ref.model.layers[-1].down)


def test_missing_tensor_is_named(hf_folder, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(next(hf_folder.glob("*.safetensors"))))
    del tensors["model.layers.3.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"]:
        (tmp_path / f).write_bytes((hf_folder / f).read_bytes())
    with pytest.raises(ModelLoadError, match="model.layers.3.mlp.up_proj.weight"):
        load_model(resolve(str(tmp_path)), dtype="float32")
