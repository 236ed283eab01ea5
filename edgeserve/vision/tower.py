"""What every family reads the same way: the tower's config and weights from an mmproj GGUF or an HF folder,
pixel normalization, and the digest of a projector's identity."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from edgeserve.errors import ModelLoadError
from edgeserve.loaders.gguf_weights import gguf_blocks
from edgeserve.loaders.weights import WeightValue
from edgeserve.vision.family import VisionSource
from edgeserve.vision.native_vit import native_matrix
from edgeserve.vision.vit import (GGUF_CLIP_NAMES, MatrixLoader, VisionTransformer, VitConfig, VitNames,
                                  load_vit_weights)

_ACT_NAMES = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu", "quick_gelu": "quick_gelu"}


class MmprojWeights:
    """A WeightSource over an mmproj GGUF, by the file's own tensor names (`v.blk.0.attn_q.weight`, `mm.*`)."""

    def __init__(self, gguf: Any):
        self.gguf = gguf
        self._names = set(gguf.tensor_names())

    def has(self, name: str) -> bool:
        return name in self._names

    def get(self, name: str, keep_int4: bool) -> WeightValue:
        if name not in self._names:
            raise ModelLoadError(f"{self.gguf.path}: tensor {name!r} is missing")
        return self.gguf.load_tensor(name, torch.float32)

    def blocks(self, name: str):
        """A 2-D tensor's GGUF block bytes for the native CPU kernels (None when not in a format they take)."""
        return gguf_blocks(self.gguf, name) if len(self.gguf.tensor_info(name).shape) == 2 else None


@dataclass
class Normalize:
    """The processor's rescale and normalize: (pixels * rescale - mean) / std per channel."""

    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale: float = 1 / 255

    def __call__(self, img: Image.Image) -> torch.Tensor:
        """An RGB image as normalized float32 [3, H, W]."""
        a = np.asarray(img, dtype=np.float32) * np.float32(self.rescale)
        a = (a - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        return torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))


def normalize_from(source: VisionSource, default: Normalize) -> Normalize:
    """The mean / std of an mmproj (clip.vision.image_mean / image_std) or an HF preprocessor_config.json."""
    if source.gguf is not None:
        meta = source.gguf.metadata
        return Normalize(tuple(meta.get("clip.vision.image_mean", default.mean)),
                         tuple(meta.get("clip.vision.image_std", default.std)), default.rescale)
    pre = source.preprocessor or {}
    return Normalize(tuple(pre.get("image_mean", default.mean)), tuple(pre.get("image_std", default.std)),
                     float(pre.get("rescale_factor", default.rescale)))


def vit_config(source: VisionSource, eps: float = 1e-6) -> tuple[VitConfig, int]:
    """The tower's shape and its image size (pixels per side) from the mmproj metadata or the HF vision_config."""
    if source.gguf is not None:
        meta = source.gguf.metadata

        def key(name: str, default: Any = None) -> Any:
            value = meta.get(f"clip.vision.{name}", default)
            if value is None:
                raise ModelLoadError(f"{source.path}: mmproj metadata is missing clip.vision.{name}")
            return value

        act = "quick_gelu" if meta.get("clip.use_gelu") is False and not meta.get("clip.use_silu") else "gelu_tanh"
        cfg = VitConfig(int(key("embedding_length")), int(key("block_count")), int(key("attention.head_count")),
                        int(key("patch_size")), layer_norm_eps=float(key("attention.layer_norm_epsilon", eps)),
                        act=act)
        return cfg, int(key("image_size"))
    assert source.config is not None
    v = source.config.get("vision_config") or {}
    act = _ACT_NAMES.get(str(v.get("hidden_act", "gelu_pytorch_tanh")))
    if act is None:
        raise ModelLoadError(f"{source.path}: vision activation {v.get('hidden_act')!r} is not supported")
    cfg = VitConfig(int(v.get("hidden_size", 1152)), int(v.get("num_hidden_layers", 27)),
                    int(v.get("num_attention_heads", 16)), int(v.get("patch_size", 14)),
                    layer_norm_eps=float(v.get("layer_norm_eps", eps)), act=act)
    return cfg, int(v.get("image_size", 224))


def load_tower(source: VisionSource, config: VitConfig, hf_prefix: str, dtype: torch.dtype,
               device: torch.device) -> tuple[VisionTransformer, Any, MatrixLoader]:
    """The ViT of `source` (HF tensors under `hf_prefix`, or the mmproj's `v.*`), the WeightSource the projector
    reads from, and the matrix loader (GGUF blocks on the native CPU kernels where they run, bfloat16 matrices on the
    native bfloat16 kernel where this CPU has it)."""
    from edgeserve.models.llama import load_matrix

    weights = MmprojWeights(source.gguf) if source.gguf is not None else source.weights

    def matrix(names: list[str]):
        return native_matrix(load_matrix(weights, names, dtype, device, keep_int4=False), device)

    names = GGUF_CLIP_NAMES if source.gguf is not None else VitNames.hf_siglip(hf_prefix)
    return VisionTransformer(config, load_vit_weights(weights, names, config, matrix), dtype), weights, matrix


def identity_digest(source: VisionSource, *settings: Any) -> bytes:
    """A digest of the projector's files (path, size, mtime) and the preprocessing settings."""
    h = hashlib.sha256()
    files = [source.path] if source.path.is_file() else sorted(source.path.glob("*.safetensors"))
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns};".encode())
    h.update(repr(settings).encode())
    return h.digest()


def special_id(tokenizer: Any, token: str, fallback: int | None = None) -> int:
    """The id of a special token the family's prompt needs (a ModelLoadError when the vocabulary lacks it)."""
    tid = tokenizer.token_to_id(token)
    if tid is None:
        tid = fallback
    if tid is None:
        raise ModelLoadError(f"the model's vocabulary has no {token!r} token (needed for image input)")
    return tid
