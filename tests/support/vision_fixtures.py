"""The module fixtures an image-input test starts from: a tiny random HF vision-language folder, transformers'
model loaded from it, and our vision family for it."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch


def vision_fixtures(make_folder: Callable[[Path], Path], folder_name: str, hf_class: str) -> tuple:
    """(folder, hf_model, family) module-scoped fixtures: `make_folder(tmp dir named folder_name)`, transformers'
    `hf_class` from it in float32, and `load_vision` of the folder with the HF text config. A test module assigns
    them to module names so that pytest finds them."""

    @pytest.fixture(scope="module")
    def folder(tmp_path_factory) -> Path:
        return make_folder(tmp_path_factory.mktemp(folder_name))

    @pytest.fixture(scope="module")
    def hf_model(folder):
        import transformers

        return getattr(transformers, hf_class).from_pretrained(folder, dtype=torch.float32).eval()

    @pytest.fixture(scope="module")
    def family(folder, hf_model):
        from edgeserve.vision.family import load_vision

        return load_vision(folder, hf_model.config.text_config)

    return folder, hf_model, family
