"""The adapter protocol every vision family implements, and the registry that picks one by projector type."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from PIL import Image

from edgeserve.errors import ModelLoadError


@dataclass
class PreparedImage:
    """What preprocessing made of one image."""

    pixel_values: torch.Tensor  # as the family's encoder wants it
    grid: tuple[int, ...]  # family-specific (e.g. Qwen's (t, h, w) patches; Idefics3's tile rows and columns)
    num_tokens: int  # how many LM embedding rows the image becomes


class VisionFamily(Protocol):
    """One family's image pipeline: preprocessing, the image's prompt tokens, the encoder + projector."""

    projector_type: str
    # whether the language model's prefill lets each image's placeholder tokens attend to each other both ways
    # (Gemma 3)
    bidirectional_images: bool

    def preprocess(self, image: Image.Image) -> PreparedImage:
        """The image resized, rescaled, normalized (and tiled) as the family's HF image processor does it."""
        ...

    def prompt_tokens(self, prepared: PreparedImage, tokenizer: Any) -> tuple[list[int], int]:
        """The token ids that stand for the image in the prompt (begin/end markers and num_tokens placeholders)
        and the offset of the first placeholder in them."""
        ...

    def encode(self, images: list[PreparedImage]) -> list[torch.Tensor]:
        """Each image's LM embedding rows [num_tokens, lm_hidden] (float32)."""
        ...

    def settings_digest(self) -> bytes:
        """A digest of the projector's weights identity and the preprocessing settings, mixed into image keys."""
        ...


@dataclass
class VisionSource:
    """Where a vision tower is read from: an mmproj GGUF (`gguf`), or an HF folder (`config`, `weights`)."""

    path: Path
    gguf: Any = None  # loaders.gguf_file.GGUFFile of an mmproj
    config: dict[str, Any] | None = None  # an HF folder's config.json
    preprocessor: dict[str, Any] | None = None  # its preprocessor_config.json
    weights: Any = None  # loaders.weights.WeightSource over the folder's safetensors

    @property
    def projector_type(self) -> str:
        """mmproj `clip.projector_type` (or `clip.vision.projector_type`), or the HF config's model_type."""
        if self.gguf is not None:
            meta = self.gguf.metadata
            kind = meta.get("clip.vision.projector_type", meta.get("clip.projector_type"))
            if not isinstance(kind, str):
                raise ModelLoadError(f"{self.path}: not an mmproj file (no clip.projector_type)")
            return kind
        assert self.config is not None
        return str(self.config.get("model_type", ""))


# (source, lm_config, dtype=..., device=...) -> the family
Factory = Callable[..., VisionFamily]
_FAMILIES: dict[str, Factory] = {}


def register(*types: str) -> Callable[[Factory], Factory]:
    """Register a family's factory `(source, lm_config, dtype=, device=) -> VisionFamily` under its projector types
    (mmproj) and HF model_types."""
    def wrap(factory: Factory) -> Factory:
        for kind in types:
            _FAMILIES[kind] = factory
        return factory
    return wrap


def _import_families() -> None:
    """The modules that register families (imported on first use: each pulls in its own code)."""
    import importlib

    for name in ("gemma3", "gemma4", "gemma4_unified", "idefics3", "qwen_vl"):
        try:
            importlib.import_module(f"edgeserve.vision.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"edgeserve.vision.{name}":
                raise


def open_source(path: str | Path) -> VisionSource:
    """A vision source at `path`: an mmproj .gguf file, or an HF folder with a vision tower."""
    p = Path(path)
    if p.is_file():
        from edgeserve.loaders.gguf_file import GGUFFile

        return VisionSource(p, gguf=GGUFFile(p))
    from edgeserve.loaders.hf_folder import HFFolder, read_json

    folder = HFFolder(p)
    pre = p / "preprocessor_config.json"
    return VisionSource(p, config=folder.config, preprocessor=read_json(pre) if pre.is_file() else {},
                        weights=folder.weights())


def has_vision(path: str | Path) -> bool:
    """Whether `path` is an HF folder whose config has a vision tower (a non-null vision_config: Gemma 4 12B's text-only
    checkpoints write `null`) of a family edgeserve knows."""
    p = Path(path)
    cfg = p / "config.json"
    if not p.is_dir() or not cfg.is_file():
        return False
    config = json.loads(cfg.read_text())
    _import_families()
    return bool(config.get("vision_config")) and str(config.get("model_type", "")) in _FAMILIES


def load_vision(path_or_mmproj: str | Path | VisionSource, lm_config: Any, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> VisionFamily:
    """The vision family for an mmproj GGUF or an HF folder, dispatched on its projector type; its encoder computes
    in `dtype` on `device` (quantized mmproj matrices stay in their blocks on the native CPU kernels when `dtype`
    is not float32)."""
    source = path_or_mmproj if isinstance(path_or_mmproj, VisionSource) else open_source(path_or_mmproj)
    _import_families()
    kind = source.projector_type
    factory = _FAMILIES.get(kind)
    if factory is None:
        raise ModelLoadError(f"{source.path}: vision projector type {kind!r} is not supported "
                             f"(supported: {', '.join(sorted(_FAMILIES))})")
    return factory(source, lm_config, dtype=dtype, device=torch.device(device))
