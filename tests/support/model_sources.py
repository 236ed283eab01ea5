"""Our config and weight source of a tiny model, as the loader reads it from an HF folder or from a GGUF file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edgeserve.loaders.gguf_file import GGUFFile
from edgeserve.loaders.gguf_weights import GGUFWeights
from edgeserve.loaders.hf_folder import HFFolder
from edgeserve.models.config import ModelConfig, config_from_gguf, config_from_hf


def folder_source(folder: Path) -> tuple[ModelConfig, Any]:
    """The config and weights of an HF folder (config.json and safetensors)."""
    config = config_from_hf(json.loads((folder / "config.json").read_text()))
    return config, HFFolder(folder).weights()


def saved_source(model: Any, folder: Path) -> tuple[ModelConfig, Any]:
    """A transformers model saved at `folder`, then read back as folder_source."""
    model.save_pretrained(folder)
    return folder_source(folder)


def gguf_source(path: Path) -> tuple[ModelConfig, GGUFWeights]:
    """The config and weights of a GGUF file."""
    g = GGUFFile(path)
    config = config_from_gguf(g.metadata, set(g.tensor_names()))
    return config, GGUFWeights(g, config.num_heads, config.num_kv_heads)
