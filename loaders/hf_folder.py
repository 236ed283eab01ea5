"""Hugging Face model folders: config.json, generation_config.json and (sharded) safetensors, read lazily."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from edgeserve.errors import ModelLoadError

from .prequantized import PrequantizedFormat, prequantized_format
from .weights import WeightValue


def read_json(path: Path) -> dict[str, Any]:
    """A JSON file as a dict, with a clear error when it is missing or malformed."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path} not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None


class HFFolder:
    """A local Hugging Face model folder."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise ModelLoadError(f"model folder not found: {self.path}")
        self.config = read_json(self.path / "config.json")
        gen = self.path / "generation_config.json"
        self.generation_config = read_json(gen) if gen.exists() else {}

    def weights(self) -> "SafetensorsWeights":
        """The folder's tensors (single file or sharded with an index)."""
        return SafetensorsWeights(self.path, prequantized_format(self.config))


class SafetensorsWeights:
    """WeightSource over one or more .safetensors files opened with safe_open (mmap, per tensor).

    With `quant` (an AWQ or GPTQ checkpoint), a layer `X` stored as `X.qweight`/`X.qzeros`/`X.scales` is served
    as `X.weight`: Q4Blocks when `keep_int4`, else dequantized."""

    def __init__(self, folder: Path, quant: PrequantizedFormat | None = None):
        from safetensors import safe_open

        index = folder / "model.safetensors.index.json"
        if index.exists():
            weight_map: dict[str, str] = read_json(index).get("weight_map", {})
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
            weight_map = {}
        if not files:
            raise ModelLoadError(f"{folder} has no *.safetensors files")
        self._handles = {}
        for f in files:
            try:
                self._handles[f] = safe_open(str(folder / f), framework="pt")
            except FileNotFoundError:
                raise ModelLoadError(f"{folder / f} not found (listed in the safetensors index)") from None
            except Exception as e:
                raise ModelLoadError(f"{folder / f} is not a valid safetensors file: {e}") from None
        if not weight_map:
            weight_map = {k: f for f, h in self._handles.items() for k in h.keys()}
        self._stored: dict[str, str] = {}  # our name -> the name stored, where they differ
        if "embed_tokens.weight" in weight_map and "model.embed_tokens.weight" not in weight_map:
            # a base model's checkpoint (Qwen3Model, Gemma3TextModel: embedding models) names its tensors without
            # the `model.` of a *ForCausalLM
            self._stored = {f"model.{k}": k for k in weight_map}
            weight_map = {**weight_map, **{f"model.{k}": f for k, f in weight_map.items()}}
        self._where = weight_map
        self.folder = folder
        self.quant = quant

    def _packed(self, name: str) -> str | None:
        """The layer prefix of `name` when it is stored as a pre-quantized (qweight) layer."""
        if self.quant is not None and name.endswith(".weight") and name not in self._where:
            prefix = name[: -len(".weight")]
            if prefix + ".qweight" in self._where:
                return prefix
        return None

    def _tensor(self, name: str) -> torch.Tensor:
        return self._handles[self._where[name]].get_tensor(self._stored.get(name, name))

    def has(self, name: str) -> bool:
        return name in self._where or self._packed(name) is not None

    def get(self, name: str, keep_int4: bool) -> WeightValue:
        prefix = self._packed(name)
        if prefix is not None:
            assert self.quant is not None
            blocks = self.quant.blocks(
                lambda suffix: self._tensor(f"{prefix}.{suffix}") if f"{prefix}.{suffix}" in self._where else None,
                prefix)
            return blocks if keep_int4 else blocks.dequantize()
        if name not in self._where:
            raise ModelLoadError(f"{self.folder}: tensor {name!r} is missing")
        return self._tensor(name).to(torch.float32)

    def stored_quantized(self) -> list[str]:
        """["awq"] or ["gptq"] for a pre-quantized checkpoint, else []."""
        return [self.quant.method] if self.quant else []
