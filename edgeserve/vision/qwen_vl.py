"""The Qwen2.5-VL and Qwen3-VL vision towers as one family adapter, from an HF folder or a llama.cpp mmproj GGUF.

Preprocessing is transformers' Qwen2VLImageProcessor: `smart_resize` to multiples of patch * merge inside a pixel
range, bicubic resize, rescale, normalize, patches in 2x2 merge-block order. An image is one temporal patch of two
equal frames, so the Conv3d patch embedding is a linear map of one frame by the sum of its two temporal kernels.

The tower: 2-D rotary positions (half the rotary frequencies on the row, half on the column), pre-norm blocks
(Qwen2.5-VL: RMSNorm, SwiGLU, window attention except on its full-attention layers; Qwen3-VL: LayerNorm, GELU MLP,
a learned position table resampled bilinearly to the image's grid), and the patch merger (2x2 neighbours
concatenated, MLP to the language model's width). Qwen3-VL's DeepStack mergers turn the outputs of some ViT layers
into extra features that the language model adds to its hidden states after its first layers: `encode` returns
them beside the main rows, as llama.cpp does, concatenated along the feature axis ([tokens, lm_hidden * (1 + k)]).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from PIL import Image

from edgeserve.errors import ModelLoadError

QWEN25_PROJECTORS = ("qwen2.5vl_merger", "qwen2_5_vl")
QWEN3_PROJECTORS = ("qwen3vl_merger", "qwen3_vl")
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# llama.cpp's limits on a Qwen image's tokens (clip.cpp set_limit_image_tokens(8, 4096)) where a file gives none
MMPROJ_MIN_TOKENS, MMPROJ_MAX_TOKENS = 8, 4096


@dataclass
class QwenVisionConfig:
    """The shape and preprocessing settings of a Qwen2.5-VL / Qwen3-VL vision tower."""

    projector_type: str  # "qwen2.5vl_merger" or "qwen3vl_merger" (llama.cpp's names)
    hidden: int
    heads: int
    depth: int
    intermediate: int
    out_hidden: int  # the language model's width
    patch: int = 14
    temporal_patch: int = 2
    merge: int = 2
    eps: float = 1e-6
    window: int = 0  # Qwen2.5-VL's attention window in pixels (0: full attention everywhere)
    full_layers: tuple[int, ...] = ()  # Qwen2.5-VL's layers with full attention
    num_position_embeddings: int = 0  # Qwen3-VL's learned position table (a square grid)
    deepstack_layers: tuple[int, ...] = ()  # Qwen3-VL's ViT layers whose outputs feed DeepStack
    rope_theta: float = 10000.0
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    @property
    def qwen3(self) -> bool:
        return self.projector_type in QWEN3_PROJECTORS

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass
class PreparedQwenImage:
    """One preprocessed image: its patches (one frame each, merge-block order) and grid."""

    pixel_values: torch.Tensor  # [h * w, 3 * patch * patch] float32
    grid: tuple[int, int, int]  # (t, h, w) in patches
    num_tokens: int  # h * w / merge^2: the language model's rows for it


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) transformers' Qwen2-VL processor resizes an image to: multiples of `factor`, the pixel
    count inside [min_pixels, max_pixels], the aspect ratio kept as closely as that allows."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image aspect ratio {max(height, width) / min(height, width):.0f} is over 200")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def preprocess(image: Image.Image, cfg: QwenVisionConfig) -> PreparedQwenImage:
    """Resize, rescale, normalize and patchify one RGB image as transformers' Qwen2VLImageProcessor does."""
    p, m = cfg.patch, cfg.merge
    h, w = smart_resize(image.height, image.width, p * m, cfg.min_pixels, cfg.max_pixels)
    resized = image.convert("RGB").resize((w, h), Image.Resampling.BICUBIC)
    x = torch.frombuffer(bytearray(resized.tobytes()), dtype=torch.uint8).view(h, w, 3).float() / 255.0
    x = (x - torch.tensor(cfg.image_mean)) / torch.tensor(cfg.image_std)
    gh, gw = h // p, w // p
    x = x.permute(2, 0, 1).reshape(3, gh // m, m, p, gw // m, m, p)
    patches = x.permute(1, 4, 2, 5, 0, 3, 6).reshape(gh * gw, 3 * p * p)
    return PreparedQwenImage(patches.contiguous(), (1, gh, gw), gh * gw // (m * m))


def merge_order(gh: int, gw: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (row, column) of each patch of a gh x gw grid in merge-block order (the order of `preprocess`)."""
    rows = torch.arange(gh).view(gh // merge, merge, 1, 1).expand(-1, -1, gw // merge, merge)
    cols = torch.arange(gw).view(1, 1, gw // merge, merge).expand(gh // merge, merge, -1, -1)
    return rows.transpose(1, 2).reshape(-1), cols.transpose(1, 2).reshape(-1)


@dataclass
class QwenVisionWeights:
    """The tower's weights by HF name without the `visual.` prefix (float32, dequantized from a GGUF)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelLoadError(f"vision tower weight {name!r} is missing") from None

    def get(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(name)


class QwenVisionTower:
    """The Qwen2.5-VL / Qwen3-VL vision transformer and patch merger over preprocessed images."""

    def __init__(self, cfg: QwenVisionConfig, weights: QwenVisionWeights):
        self.cfg, self.w = cfg, weights
        conv = weights["patch_embed.proj.weight"]  # [hidden, 3, T, p, p]
        # two equal frames: the temporal kernels sum (transformers repeats the frame; same product)
        self.patch_weight = conv.sum(2).reshape(cfg.hidden, -1) if conv.dim() == 5 else conv.reshape(cfg.hidden, -1)
        self.patch_bias = weights.get("patch_embed.proj.bias")
        d = cfg.head_dim // 2
        self.inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)

    @torch.inference_mode()
    def forward(self, image: PreparedQwenImage) -> torch.Tensor:
        """The merged features of one image: [num_tokens, out_hidden * (1 + len(deepstack_layers))]."""
        cfg = self.cfg
        _, gh, gw = image.grid
        x = F.linear(image.pixel_values.float(), self.patch_weight, self.patch_bias)
        rows, cols = merge_order(gh, gw, cfg.merge)
        if cfg.qwen3:
            x = x + self._learned_positions(gh, gw)[rows, cols]
        freqs = torch.cat([rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq], dim=-1)
        freqs = torch.cat([freqs, freqs], dim=-1)
        cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
        window_mask = self._window_mask(rows, cols) if cfg.window else None
        deep = []
        for i in range(cfg.depth):
            mask = None if i in cfg.full_layers else window_mask
            x = self._block(i, x, cos, sin, mask)
            if i in cfg.deepstack_layers:
                deep.append(self._merger(f"deepstack_merger_list.{cfg.deepstack_layers.index(i)}.", x, post=True))
        merged = self._merger("merger.", x, post=False)
        return torch.cat([merged, *deep], dim=-1) if deep else merged

    def _learned_positions(self, gh: int, gw: int) -> torch.Tensor:
        """Qwen3-VL's square position table resampled (bilinear, corners aligned) to a gh x gw grid."""
        table = self.w["pos_embed.weight"]
        side = int(math.isqrt(table.shape[0]))
        grid = table.view(side, side, -1).permute(2, 0, 1)[None]
        return F.interpolate(grid, size=(gh, gw), mode="bilinear", align_corners=True)[0].permute(1, 2, 0)

    def _window_mask(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Qwen2.5-VL's window attention as a mask: patches attend within their window of merged units."""
        units = self.cfg.window // self.cfg.merge // self.cfg.patch
        span = units * self.cfg.merge  # window side in patches
        wid = (rows // span) * 100003 + cols // span
        return wid[:, None] == wid[None, :]

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.w[name + ".weight"], self.w.get(name + ".bias")
        if self.cfg.qwen3:
            return F.layer_norm(x, (x.shape[-1],), weight, bias, self.cfg.eps)
        return F.rms_norm(x, (x.shape[-1],), weight, self.cfg.eps)

    def _block(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        cfg, w, p = self.cfg, self.w, f"blocks.{i}."
        n = x.shape[0]
        h = self._norm(p + "norm1", x)
        q, k, v = F.linear(h, w[p + "attn.qkv.weight"], w.get(p + "attn.qkv.bias")).view(
            n, 3, cfg.heads, cfg.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
        x = x + F.linear(o.transpose(0, 1).reshape(n, -1), w[p + "attn.proj.weight"], w.get(p + "attn.proj.bias"))
        h = self._norm(p + "norm2", x)
        if cfg.qwen3:
            y = F.gelu(F.linear(h, w[p + "mlp.linear_fc1.weight"], w.get(p + "mlp.linear_fc1.bias")), approximate="tanh")
            return x + F.linear(y, w[p + "mlp.linear_fc2.weight"], w.get(p + "mlp.linear_fc2.bias"))
        gate = F.linear(h, w[p + "mlp.gate_proj.weight"], w.get(p + "mlp.gate_proj.bias"))
        up = F.linear(h, w[p + "mlp.up_proj.weight"], w.get(p + "mlp.up_proj.bias"))
        return x + F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"], w.get(p + "mlp.down_proj.bias"))

    def _merger(self, prefix: str, x: torch.Tensor, post: bool) -> torch.Tensor:
        """A patch merger: each 2x2 block's features concatenated, normed (before the concatenation, or after it
        for DeepStack's `post` mergers), then a GELU MLP to the language model's width."""
        cfg, w = self.cfg, self.w
        wide = cfg.hidden * cfg.merge * cfg.merge
        if cfg.qwen3:
            x = self._norm(prefix + "norm", x.reshape(-1, wide) if post else x).reshape(-1, wide)
            fc1, fc2 = prefix + "linear_fc1", prefix + "linear_fc2"
        else:
            x = self._norm(prefix + "ln_q", x).reshape(-1, wide)
            fc1, fc2 = prefix + "mlp.0", prefix + "mlp.2"
        x = F.gelu(F.linear(x, w[fc1 + ".weight"], w.get(fc1 + ".bias")))
        return F.linear(x, w[fc2 + ".weight"], w.get(fc2 + ".bias"))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the rotate-half layout ([n, heads, d] by [n, 1, d] tables)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


# ---- loading -------------------------------------------------------------------------------------------------


def config_from_hf(cfg: Mapping[str, Any], preprocessor: Mapping[str, Any] | None = None) -> QwenVisionConfig:
    """The tower's config from an HF Qwen2.5-VL / Qwen3-VL `config.json` (and `preprocessor_config.json`)."""
    model_type = cfg.get("model_type")
    v = cfg.get("vision_config") or {}
    qwen3 = model_type in ("qwen3_vl", "qwen3_vl_moe")
    if model_type not in ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"):
        raise ModelLoadError(f"config.json model_type {model_type!r} is not a Qwen2.5-VL / Qwen3-VL model")
    text = cfg.get("text_config") or cfg
    out = int(v.get("out_hidden_size") or text.get("hidden_size"))
    patch = int(v.get("patch_size", 16 if qwen3 else 14))
    pre = dict(preprocessor or {})
    size = pre.get("size") or {}
    fields: dict[str, Any] = dict(
        projector_type=QWEN3_PROJECTORS[0] if qwen3 else QWEN25_PROJECTORS[0],
        hidden=int(v["hidden_size"]), heads=int(v["num_heads"]), depth=int(v["depth"]),
        intermediate=int(v["intermediate_size"]), out_hidden=out, patch=patch,
        temporal_patch=int(v.get("temporal_patch_size", 2)), merge=int(v.get("spatial_merge_size", 2)),
        window=0 if qwen3 else int(v.get("window_size", 112)),
        full_layers=tuple(v.get("fullatt_block_indexes") or ()),
        num_position_embeddings=int(v.get("num_position_embeddings", 0)) if qwen3 else 0,
        deepstack_layers=tuple(v.get("deepstack_visual_indexes") or ()) if qwen3 else (),
        image_mean=tuple(pre.get("image_mean") or ((0.5,) * 3 if qwen3 else OPENAI_CLIP_MEAN)),
        image_std=tuple(pre.get("image_std") or ((0.5,) * 3 if qwen3 else OPENAI_CLIP_STD)),
        min_pixels=int(pre.get("min_pixels") or size.get("shortest_edge") or (65536 if qwen3 else 56 * 56)),
        max_pixels=int(pre.get("max_pixels") or size.get("longest_edge") or (16777216 if qwen3 else 28 * 28 * 1280)),
    )
    return QwenVisionConfig(**fields)


def weights_from_state(state: Mapping[str, torch.Tensor]) -> QwenVisionWeights:
    """The tower's weights from HF tensors named `visual.*` or `model.visual.*` (others are ignored)."""
    out = {}
    for name, t in state.items():
        for prefix in ("model.visual.", "visual."):
            if name.startswith(prefix):
                out[name[len(prefix):]] = t.float()
    return QwenVisionWeights(out)


def load_hf(folder: str | Path) -> QwenVisionTower:
    """The vision tower of an HF Qwen2.5-VL / Qwen3-VL folder (safetensors)."""
    from safetensors import safe_open

    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    pre_path = folder / "preprocessor_config.json"
    pre = json.loads(pre_path.read_text()) if pre_path.is_file() else None
    state = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                if ".visual." in f".{name}":
                    state[name] = f.get_tensor(name)
    return QwenVisionTower(config_from_hf(cfg, pre), weights_from_state(state))


# llama.cpp mmproj names (clip-impl.h / gguf-py tensor_mapping) of the tower's HF names, per block
_GGUF_BLOCK = {
    "ln1": "norm1", "ln2": "norm2", "attn_qkv": "attn.qkv", "attn_out": "attn.proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GGUF_BLOCK_QWEN3 = {**_GGUF_BLOCK, "ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2"}


def hf_name_of_gguf(name: str, qwen3: bool, deepstack: tuple[int, ...]) -> str | None:
    """The HF name (without `visual.`) of an mmproj tensor name; None for names the tower does not use."""
    parts = name.split(".")
    kind = parts[-1]
    if name.startswith("v.blk."):
        i, base = parts[2], parts[3]
        hf = (_GGUF_BLOCK_QWEN3 if qwen3 else _GGUF_BLOCK).get(base)
        return f"blocks.{i}.{hf}.{kind}" if hf else None
    if name.startswith("v.deepstack."):
        i, base = int(parts[2]), {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}[parts[3]]
        return f"deepstack_merger_list.{deepstack.index(i)}.{base}.{kind}"
    if name.startswith("v.post_ln."):
        return f"merger.{'norm' if qwen3 else 'ln_q'}.{kind}"
    if name.startswith("mm."):
        return _merger_name(int(parts[1]), qwen3) + f".{kind}"
    if name == "v.position_embd.weight":
        return "pos_embed.weight"
    if name == "v.patch_embd.bias":
        return "patch_embed.proj.bias"
    return None


def _merger_name(index: int, qwen3: bool) -> str:
    names = {0: "linear_fc1", 2: "linear_fc2"} if qwen3 else {0: "mlp.0", 2: "mlp.2"}
    if index not in names:
        raise ModelLoadError(f"mmproj tensor mm.{index} is not part of a Qwen merger")
    return "merger." + names[index]


def config_from_gguf(meta: Mapping[str, Any], tensor_names: list[str]) -> QwenVisionConfig:
    """The tower's config from an mmproj GGUF's `clip.*` metadata (llama.cpp's converter)."""
    ptype = meta.get("clip.vision.projector_type") or meta.get("clip.projector_type")
    qwen3 = ptype in QWEN3_PROJECTORS

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"clip.vision.{name}", default)
        if value is None:
            raise ModelLoadError(f"mmproj GGUF has no clip.vision.{name}")
        return value

    depth = int(key("block_count"))
    patch, merge = int(key("patch_size")), int(key("spatial_merge_size", 2))
    deep_flags = key("is_deepstack_layers", [False] * depth) if qwen3 else []
    wa = int(key("n_wa_pattern", 0)) if not qwen3 else 0
    tokens_px = (patch * merge) ** 2
    pos = [n for n in tensor_names if n == "v.position_embd.weight"]
    return QwenVisionConfig(
        projector_type=QWEN3_PROJECTORS[0] if qwen3 else QWEN25_PROJECTORS[0],
        hidden=int(key("embedding_length")), heads=int(key("attention.head_count")), depth=depth,
        intermediate=int(key("feed_forward_length")), out_hidden=int(key("projection_dim")),
        patch=patch, merge=merge, eps=float(key("attention.layer_norm_epsilon", 1e-6)),
        window=int(key("window_size", 112)) if wa else 0,
        full_layers=tuple(i for i in range(depth) if (i + 1) % wa == 0) if wa else (),
        num_position_embeddings=1 if pos else 0,
        deepstack_layers=tuple(i for i, f in enumerate(deep_flags) if f),
        image_mean=tuple(key("image_mean", OPENAI_CLIP_MEAN)), image_std=tuple(key("image_std", OPENAI_CLIP_STD)),
        min_pixels=int(meta.get("clip.vision.image_min_pixels") or MMPROJ_MIN_TOKENS * tokens_px),
        max_pixels=int(meta.get("clip.vision.image_max_pixels") or MMPROJ_MAX_TOKENS * tokens_px),
    )


def load_mmproj(path: str | Path) -> QwenVisionTower:
    """The vision tower of a llama.cpp Qwen2.5-VL / Qwen3-VL mmproj GGUF (any tensor type; dequantized)."""
    from edgeserve.loaders.gguf_file import GGUFFile

    g = GGUFFile(path)
    names = g.tensor_names()
    cfg = config_from_gguf(g.metadata, names)
    out: dict[str, torch.Tensor] = {}
    conv = [g.load_tensor(n) for n in ("v.patch_embd.weight", "v.patch_embd.weight.1") if n in names]
    if not conv:
        raise ModelLoadError(f"{path}: mmproj has no v.patch_embd.weight")
    out["patch_embed.proj.weight"] = torch.stack(conv, dim=2)  # [hidden, 3, T, p, p]
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    for n in names:
        if n.startswith("v.blk.") and n.split(".")[3] in ("attn_q", "attn_k", "attn_v"):
            qkv.setdefault(f"blocks.{n.split('.')[2]}.attn.qkv.{n.split('.')[-1]}", {})[n.split(".")[3]] = \
                g.load_tensor(n)
            continue
        hf = hf_name_of_gguf(n, cfg.qwen3, cfg.deepstack_layers)
        if hf is not None:
            out[hf] = g.load_tensor(n)
    for hf, parts in qkv.items():  # Qwen2.5-VL's converter splits the fused projection
        out[hf] = torch.cat([parts["attn_q"], parts["attn_k"], parts["attn_v"]])
    return QwenVisionTower(cfg, QwenVisionWeights(out))


def settings_digest(cfg: QwenVisionConfig, weights: QwenVisionWeights, source: str) -> bytes:
    """A digest of the preprocessing settings and the projector (its file's identity and shape)."""
    h = hashlib.sha256(repr((cfg, source, sorted((k, tuple(v.shape)) for k, v in weights.tensors.items()))).encode())
    return h.digest()
