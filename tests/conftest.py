"""Shared fixtures: the real default model (pulled once into the user cache) and its reference."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Triton fixes interpret-or-compile when `triton.language` is first imported (its own helpers are jitted
# then), and the engine imports it through kernels.dispatch: so the CPU interpreter must be chosen here,
# before any test module is collected. Without CUDA, the Triton kernels are tested in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(default_model_path.parent), gguf_file=default_model_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def reference_tokenizer(default_model_path):
    """transformers' tokenizer loaded from the same GGUF."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(default_model_path.parent), gguf_file=default_model_path.name)


@pytest.fixture(scope="session")
def default_model(default_model_path):
    """The default model on the default path (4-bit weights packed, bf16 compute), loaded once."""
    from edgeserve.models.load import load_model
    from edgeserve.registry import resolve

    return load_model(resolve(str(default_model_path)))
