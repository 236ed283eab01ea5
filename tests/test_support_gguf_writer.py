"""The tests' one GGUF writer (tests/support/gguf_writer.py) against llama.cpp's own convert_hf_to_gguf.py: the same
tiny random checkpoint written both ways gives the same tensors (names, shapes, GGML types, values) and the same
values of every metadata key edgeserve's config reader reads, so a test GGUF stands in for a real file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from converter_cases import BY_NAME  # noqa: E402
from support.gguf_writer import matrices, write_model_gguf  # noqa: E402

from edgeserve.loaders.gguf_file import GGUFFile  # noqa: E402
from edgeserve.models.config import config_from_gguf  # noqa: E402

# case -> (converter flags, how our writer stores the matrices: gpt-oss's experts are MXFP4 in the checkpoint, and
# the converter keeps them so)
CASES = {
    "llama": ((), "F32"),
    "qwen3": ((), "F32"),
    "qwen3moe": ((), "F32"),
    "gemma3": ((), "F32"),
    "gemma4-e2b": ((), "F32"),
    "gemma4-26b-a4b": ((), "F32"),
    "gpt-oss": ((), matrices("F32", experts="MXFP4")),
    "qwen35": ((), "F32"),
    "qwen35moe-mtp": (("--no-mtp",), "F32"),
    "gemma2": ((), "F32"),
    "phi3": ((), "F32"),
    "olmo2": ((), "F32"),
    "mistral3": ((), "F32"),
    "granite": ((), "F32"),
    "lfm2": ((), "F32"),  # the part of our lfm3 naming that is lfm2's (archs/lfm3)
}


class ReadKeys(dict):
    """A metadata dict that records the keys read from it."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-6 * max(abs(a), 1.0)
    return a == b


@pytest.mark.parametrize("name", list(CASES))
def test_our_writer_writes_what_the_converter_writes(name: str, checkpoints, tmp_path: Path) -> None:
    flags, qtype = CASES[name]
    model, _, converted = checkpoints(name, *flags)
    arch = BY_NAME[name].arch
    theirs = GGUFFile(converted)
    ours = GGUFFile(write_model_gguf(model, tmp_path / "ours.gguf", arch, qtype=qtype))

    assert sorted(ours.tensor_names()) == sorted(theirs.tensor_names())
    for n in theirs.tensor_names():
        a, b = theirs.tensor_info(n), ours.tensor_info(n)
        assert (b.shape, b.qtype) == (a.shape, a.qtype), n
        assert torch.allclose(ours.load_tensor(n, torch.float32), theirs.load_tensor(n, torch.float32), atol=1e-6), n

    read = ReadKeys(theirs.metadata)
    reference = config_from_gguf(read, set(theirs.tensor_names()))
    model_keys = {k for k in read.read if k.startswith(f"{arch}.")}
    assert model_keys, "the config reader read no model keys"
    for key in sorted(model_keys):
        assert (key in ours.metadata) == (key in theirs.metadata), key
        if key in theirs.metadata:
            assert _same_value(ours.metadata[key], theirs.metadata[key]), key
    assert config_from_gguf(ours.metadata, set(ours.tensor_names())) == reference
