"""A sentence-transformers folder's head: what `modules.json` puts after the transformer (Pooling, Dense, Normalize).

Qwen3-Embedding (last-token pooling + Normalize) and EmbeddingGemma (mean pooling, two Dense projections without
bias or activation, Normalize) are published this way. Dense weights are `linear.weight` in the module folder's
`model.safetensors`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from edgeserve.errors import ModelLoadError, UnsupportedModelError

_IDENTITY = ("torch.nn.modules.linear.Identity", "Identity", None)


@dataclass
class SentenceHead:
    """Pooling mode, the projections after it ([out, in] float32 each, in order) and whether vectors are
    L2-normalized."""

    pooling: str
    dense: tuple[torch.Tensor, ...] = ()
    normalize: bool = False


def _modules(folder: Path) -> list[dict]:
    try:
        modules = json.loads((folder / "modules.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    except ValueError as e:
        raise ModelLoadError(f"{folder}/modules.json is not valid JSON: {e}") from None
    return modules if isinstance(modules, list) else []


def has_pooling(folder: Path) -> bool:
    """Whether a folder's modules.json has a Pooling module (a sentence-transformers embedding model)."""
    return any(str(m.get("type", "")).endswith("Pooling") for m in _modules(folder) if isinstance(m, dict))


def _dense(folder: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if cfg.get("bias") or cfg.get("activation_function") not in _IDENTITY:
        raise UnsupportedModelError(f"{folder}: a Dense module with a bias or activation "
                                    f"({cfg.get('activation_function')}) is not supported")
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise ModelLoadError(f"{folder} has no model.safetensors (Dense weights)")
    return load_file(str(weights))["linear.weight"].float()


def sentence_head(folder: Path) -> SentenceHead:
    """The Pooling / Dense / Normalize modules of a sentence-transformers folder, in order."""
    from edgeserve.models.encoders.bert import _pooling_mode

    head = SentenceHead("mean")
    dense: list[torch.Tensor] = []
    for m in _modules(folder):
        kind, sub = str(m.get("type", "")), folder / str(m.get("path", ""))
        if kind.endswith("Pooling"):
            head.pooling = _pooling_mode(json.loads((sub / "config.json").read_text(encoding="utf-8")), folder)
        elif kind.endswith("Dense"):
            dense.append(_dense(sub))
        elif kind.endswith("Normalize"):
            head.normalize = True
    head.dense = tuple(dense)
    return head
