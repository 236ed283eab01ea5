"""Session fixtures of the converter-parity harness (tests/converter_parity.py), shared by every test module that
uses them (registered in conftest.py's pytest_plugins): tokenizer folders, checkpoints converted once a session,
transformers' reference logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def tokenizer_dirs(default_model_path: Path, tmp_path_factory):
    """get(Case.tokenizer) -> its folder of tokenizer files, made once a session."""
    from converter_parity import spm_tokenizer_folder, tokenizer_folder

    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            dest = tmp_path_factory.mktemp(f"tokenizer-{kind}")
            made[kind] = tokenizer_folder(default_model_path, dest) if kind == "bpe" else spm_tokenizer_folder(dest)
        return made[kind]

    return get


@pytest.fixture(scope="session")
def checkpoints(tokenizer_dirs, tmp_path_factory):
    """get(name, *converter flags, outtype="f32") -> (transformers model, HF folder, GGUF), built and converted once a
    session."""
    from converter_cases import BY_NAME
    from converter_parity import build_checkpoint, convert

    made: dict = {}

    def get(name: str, *flags: str, outtype: str = "f32"):
        case = BY_NAME[name]
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            made[name] = (build_checkpoint(case, tokenizer_dirs(case.tokenizer), folder), folder, {})
        model, folder, ggufs = made[name]
        key = (flags or case.convert_args, outtype)
        if key not in ggufs:
            out = folder.parent / f"{name}{''.join(key[0])}.{outtype}.gguf"
            ggufs[key] = case.writer(model, out, outtype.upper()) if case.writer else \
                convert(folder, out, *key[0], outtype=outtype)
        return model, folder, ggufs[key]

    return get


@pytest.fixture(scope="session")
def reference(checkpoints):
    """get(name) -> transformers' float32 logits of the case's checkpoint, once a session."""
    from converter_parity import reference_logits

    cache: dict[str, torch.Tensor] = {}

    def get(name: str) -> torch.Tensor:
        if name not in cache:
            cache[name] = reference_logits(checkpoints(name)[0])
        return cache[name]

    return get
