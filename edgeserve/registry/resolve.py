"""Turn what the user typed (a catalog name or a local path) into a model on disk."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from edgeserve.errors import ModelLoadError, PullError, UnknownModelError
from edgeserve.registry.catalog import CATALOG
from edgeserve.registry.pull import cached_path, is_pulled, pull

_GGUF_MAGIC = b"GGUF"


@dataclass
class ModelSource:
    """A model on disk: a GGUF file or a Hugging Face folder (config.json + weights)."""

    name: str
    kind: Literal["gguf", "hf"]
    path: Path


def source_bytes(source: ModelSource) -> int:
    """Size on disk of a model's weights (the GGUF file, or the folder's *.safetensors files)."""
    if source.kind == "gguf":
        from edgeserve.loaders.gguf_file import gguf_parts

        return sum(p.stat().st_size for p in gguf_parts(source.path) if p.is_file())  # every part of a split model
    return sum(p.stat().st_size for p in source.path.glob("*.safetensors"))


def resolve(name_or_path: str, pull_missing: bool = True) -> ModelSource:
    """Find the model for a catalog name, a .gguf file path or a Hugging Face folder path.

    A catalog model that is not pulled yet is pulled when `pull_missing` is True.
    Raises ModelLoadError for missing or unusable paths and UnknownModelError for
    anything that is neither a catalog name nor a path.
    """
    from edgeserve.registry import hf

    ref = hf.parse(name_or_path) if name_or_path not in CATALOG else None
    if ref is not None:
        local = hf.local_path(name_or_path)
        if local is None and not pull_missing:
            raise ModelLoadError(f"model {ref.name!r} is not pulled yet; run `edgeserve pull {ref.name}`")
        if local is None:
            try:
                local = hf.pull_hf(name_or_path)
            except PullError as e:
                if ref.gguf:
                    raise
                # a bare OWNER/REPO may as well have been meant as a local folder
                raise ModelLoadError(f"model path not found: {name_or_path}, nor pulled from Hugging Face: {e}") \
                    from None
        return ModelSource(ref.name, "gguf" if ref.gguf else "hf", local)
    if name_or_path in CATALOG:
        name = name_or_path
        kind = "hf" if CATALOG[name].folder_weights else "gguf"
        if is_pulled(name):
            return ModelSource(name, kind, cached_path(name))
        if not pull_missing:
            raise ModelLoadError(f"model {name!r} is not pulled yet; run `edgeserve pull {name}`")
        return ModelSource(name, kind, pull(name))

    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"{path} has no config.json; a Hugging Face model folder needs config.json, "
                "the *.safetensors weights and tokenizer files"
            )
        return ModelSource(path.resolve().name, "hf", path.resolve())
    if path.is_file() and path.suffix.lower() == ".json":  # a bare config.json: only `--load-format dummy` loads it
        return ModelSource(path.resolve().stem if path.name != "config.json" else path.resolve().parent.name, "hf",
                           path.resolve())
    if path.is_file():
        if path.suffix.lower() != ".gguf" and not has_gguf_magic(path):
            raise ModelLoadError(f"{path} is not a .gguf file; pass a .gguf file or a Hugging Face folder")
        # absolute, not resolved: messages name the path the operator gave, never a symlink's target
        return ModelSource(path.stem, "gguf", path.absolute())
    if _looks_like_path(name_or_path):
        raise ModelLoadError(f"model path not found: {path}")
    from edgeserve.registry.catalog import HF_CATALOG

    raise UnknownModelError(
        f"unknown model {name_or_path!r}; catalog models: {', '.join([*CATALOG, *HF_CATALOG])} "
        "(a path to a .gguf file or a Hugging Face folder, hf.co/OWNER/REPO[:QUANT] or OWNER/REPO also work)"
    )


def list_local() -> list[ModelSource]:
    """The catalog models that are pulled and verified, in catalog order, then the pulled Hugging Face models."""
    from edgeserve.registry import hf

    local = [ModelSource(name, "hf" if e.folder_weights else "gguf", cached_path(name))
             for name, e in CATALOG.items() if is_pulled(name)]
    return local + [ModelSource(name, "hf" if path.is_dir() else "gguf", path) for name, path in hf.list_pulled()]


def _looks_like_path(s: str) -> bool:
    seps = {os.sep, "/"} | ({os.altsep} if os.altsep else set())
    return any(c in s for c in seps) or s.startswith((".", "~")) or s.lower().endswith(".gguf")


def has_gguf_magic(path: Path) -> bool:
    """Whether `path` is a readable file that starts with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == _GGUF_MAGIC
    except OSError:
        return False
