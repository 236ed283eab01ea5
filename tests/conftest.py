"""Shared fixtures: the real default model (pulled once into the user cache) and its reference."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import subfolders  # noqa: F401  (tests/ and its subfolders on sys.path: tests import helpers by module name)
import torch

# Triton fixes interpret-or-compile when `triton.language` is first imported (its own helpers are jitted
# then), and the engine imports it through kernels.dispatch: so the CPU interpreter must be chosen here,
# before any test module is collected. Without CUDA, the Triton kernels are tested in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the converter-parity fixtures (checkpoints converted once a session), shared by the modules that use them
pytest_plugins = ("converter_fixtures",)


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The default model's GGUF, pulled once into the user cache folder (the only network access of the tests)."""
    from edgeserve.registry import DEFAULT_MODEL, pull

    return pull(DEFAULT_MODEL, progress=False)


@pytest.fixture(scope="session")
def default_model_fp32(default_model_path):
    """The default model loaded by edgeserve with float32 compute (weights dequantized exactly)."""
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    return load_model(resolve(str(default_model_path)), dtype="float32")


@pytest.fixture(scope="session")
def reference_model(default_model_path):
    """transformers' float32 model loaded from the same GGUF: the correctness reference."""
    import accelerate  # noqa: F401  (transformers needs it to load GGUF)
    import transformers
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(default_model_path.parent), gguf_file=default_model_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def reference_tokenizer(default_model_path):
    """transformers' tokenizer loaded from the same GGUF."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(default_model_path.parent), gguf_file=default_model_path.name)


@pytest.fixture(scope="session")
def default_model(default_model_path):
    """The default model on the default path (4-bit weights packed, bf16 compute, prompt tokens through the
    dense copies: what `auto` picks on any machine with a few GB free), loaded once."""
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    return load_model(resolve(str(default_model_path)), dense_prefill="on")


def write_hf_copy(out: Path, reference_model, reference_tokenizer, dtype: torch.dtype) -> Path:
    """transformers' conversion of the default GGUF as a Hugging Face folder: dequantized safetensors in `dtype`,
    config.json and tokenizer files (transformers refuses save_pretrained on a GGUF-loaded model)."""
    import json

    from safetensors.torch import save_file

    state = {k: v.to(dtype).contiguous() for k, v in reference_model.state_dict().items()
             if k != "lm_head.weight"}  # tied to embed_tokens
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = reference_model.config.to_dict()
    config.pop("quantization_config", None)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    reference_tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def default_model_hf_fp16(tmp_path_factory, reference_model, reference_tokenizer) -> Path:
    """The default model as an fp16 safetensors Hugging Face folder (see write_hf_copy)."""
    return write_hf_copy(tmp_path_factory.mktemp("smollm2-hf"), reference_model, reference_tokenizer, torch.float16)


@pytest.fixture(scope="session")
def minilm() -> Path:
    """The all-minilm catalog folder (BERT), pulled once into the user cache."""
    from edgeserve.registry import pull

    return pull("all-minilm", progress=False)


@pytest.fixture(scope="session")
def minilm_tokenizer(minilm):
    """all-minilm's `tokenizers` tokenizer, padding and truncation off."""
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(minilm / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    return tok
