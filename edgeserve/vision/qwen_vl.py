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

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from PIL import Image

from edgeserve.errors import ModelLoadError

from .family import PreparedImage, VisionSource, register
from .images import ImageError
from .tower import MmprojWeights, identity_digest, special_id
from .vit import VisionTransformer, VitConfig, VitLayer, VitWeights

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


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) transformers' Qwen2-VL processor resizes an image to: multiples of `factor`, the pixel
    count inside [min_pixels, max_pixels], the aspect ratio kept as closely as that allows."""
    if max(height, width) / min(height, width) > 200:  # the processor's limit too
        raise ImageError(f"image of {width}x{height} pixels: its aspect ratio is over the model's limit of 200",
                         "image")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def preprocess(image: Image.Image, cfg: QwenVisionConfig) -> PreparedImage:
    """Resize, rescale, normalize and patchify one RGB image as transformers' Qwen2VLImageProcessor does: its
    patches [h * w, 3 * patch * patch] (one frame each, merge-block order), grid (1, h, w) in patches."""
    p, m = cfg.patch, cfg.merge
    h, w = smart_resize(image.height, image.width, p * m, cfg.min_pixels, cfg.max_pixels)
    resized = image.convert("RGB").resize((w, h), Image.Resampling.BICUBIC)
    x = torch.frombuffer(bytearray(resized.tobytes()), dtype=torch.uint8).view(h, w, 3).float() / 255.0
    x = (x - torch.tensor(cfg.image_mean)) / torch.tensor(cfg.image_std)
    gh, gw = h // p, w // p
    x = x.permute(2, 0, 1).reshape(3, gh // m, m, p, gw // m, m, p)
    patches = x.permute(1, 4, 2, 5, 0, 3, 6).reshape(gh * gw, 3 * p * p)
    return PreparedImage(patches.contiguous(), (1, gh, gw), gh * gw // (m * m))


def merge_order(gh: int, gw: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (row, column) of each patch of a gh x gw grid in merge-block order (the order of `preprocess`)."""
    rows = torch.arange(gh).view(gh // merge, merge, 1, 1).expand(-1, -1, gw // merge, merge)
    cols = torch.arange(gw).view(1, 1, gw // merge, merge).expand(gh // merge, merge, -1, -1)
    return rows.transpose(1, 2).reshape(-1), cols.transpose(1, 2).reshape(-1)


class QwenSource:
    """The tower's tensors by HF name without the `visual.` prefix, from an HF folder's WeightSource or an mmproj
    GGUF (llama.cpp's names), with GGUF block bytes (`blocks`) for the native CPU kernels."""

    def __init__(self, cfg: QwenVisionConfig, weights: Any = None, gguf: Any = None):
        self.cfg, self.gguf = cfg, gguf
        self.weights = MmprojWeights(gguf) if gguf is not None else weights
        self.prefix = ""
        if gguf is None:
            prefix = next((p for p in ("model.visual.", "visual.") if weights.has(p + "patch_embed.proj.weight")), None)
            if prefix is None:
                raise ModelLoadError("no Qwen vision tower (visual.patch_embed.proj.weight) in the weights")
            self.prefix = prefix

    def _name(self, name: str) -> str:
        return self.prefix + name if self.gguf is None else gguf_name(name, self.cfg.deepstack_layers)

    def has(self, name: str) -> bool:
        return self.weights.has(self._name(name))

    def get(self, name: str, keep_int4: bool = False) -> torch.Tensor:
        if not self.has(name):
            raise ModelLoadError(f"vision tower weight {name!r} ({self._name(name)}) is missing")
        return self.weights.get(self._name(name), keep_int4=False).float()

    def blocks(self, name: str) -> Any:
        """A matrix's GGUF block bytes for the native CPU kernels (None from an HF folder)."""
        return self.weights.blocks(self._name(name)) if self.gguf is not None else None

    def patch_weight(self) -> torch.Tensor:
        """The patch embedding over one frame [hidden, 3 * p * p]: the Conv3d's temporal kernels summed (an image
        is two equal frames), from HF's Conv3d or llama.cpp's two Conv2d halves."""
        if self.gguf is None:
            conv = self.get("patch_embed.proj.weight")
            conv = conv.sum(2) if conv.dim() == 5 else conv
        else:
            halves = [n for n in ("v.patch_embd.weight", "v.patch_embd.weight.1") if n in self.gguf.tensor_names()]
            if not halves:
                raise ModelLoadError("mmproj has no v.patch_embd.weight")
            conv = sum(self.gguf.load_tensor(n) for n in halves)
        return conv.reshape(conv.shape[0], -1)


_GGUF_BLOCK_NAMES = {"norm1": "ln1", "norm2": "ln2", "attn.qkv": "attn_qkv", "attn.q": "attn_q", "attn.k": "attn_k",
                     "attn.v": "attn_v", "attn.proj": "attn_out", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                     "mlp.down_proj": "ffn_down", "mlp.linear_fc1": "ffn_up", "mlp.linear_fc2": "ffn_down"}
_GGUF_NAMES = {"merger.ln_q": "v.post_ln", "merger.norm": "v.post_ln", "merger.mlp.0": "mm.0",
               "merger.linear_fc1": "mm.0", "merger.mlp.2": "mm.2", "merger.linear_fc2": "mm.2",
               "pos_embed": "v.position_embd", "patch_embed.proj": "v.patch_embd"}
_GGUF_DEEPSTACK = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}


def gguf_name(name: str, deepstack: tuple[int, ...]) -> str:
    """The mmproj GGUF name (llama.cpp's converter: clip-impl.h / gguf-py) of a tower tensor's HF name (without
    `visual.`); Qwen2.5-VL's converter splits the fused qkv into attn_q / attn_k / attn_v (`attn.q` ... here)."""
    stem, kind = name.rsplit(".", 1)
    parts = stem.split(".")
    if parts[0] == "blocks":
        return f"v.blk.{parts[1]}.{_GGUF_BLOCK_NAMES.get('.'.join(parts[2:]), stem)}.{kind}"
    if parts[0] == "deepstack_merger_list":
        return f"v.deepstack.{deepstack[int(parts[1])]}.{_GGUF_DEEPSTACK.get(parts[2], stem)}.{kind}"
    return f"{_GGUF_NAMES.get(stem, stem)}.{kind}"


class QwenVisionTower:
    """The Qwen2.5-VL / Qwen3-VL vision transformer (vit.py's, with 2-D rotary positions) and its patch mergers."""

    def __init__(self, cfg: QwenVisionConfig, source: QwenSource, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        from edgeserve.models.llama import load_matrix

        self.cfg, self.dtype = cfg, dtype
        device = torch.device(device)

        def vec(name: str) -> torch.Tensor | None:
            return source.get(name).to(device) if source.has(name) else None

        def matrix(names: list[str]) -> Any:
            return load_matrix(source, names, dtype, device)

        def norm(name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
            return source.get(name + ".weight").to(device), vec(name + ".bias")

        def cat(names: list[str]) -> torch.Tensor | None:
            found = [vec(n + ".bias") for n in names]
            return None if any(b is None for b in found) else torch.cat(found)  # type: ignore[arg-type]

        layers = []
        for i in range(cfg.depth):
            p = f"blocks.{i}."
            qkv = [p + "attn.qkv"] if source.has(p + "attn.qkv.weight") else [p + f"attn.{x}" for x in "qkv"]
            up, down = ("mlp.linear_fc1", "mlp.linear_fc2") if cfg.qwen3 else ("mlp.up_proj", "mlp.down_proj")
            layers.append(VitLayer(
                norm1=norm(p + "norm1"), qkv=matrix([n + ".weight" for n in qkv]), qkv_bias=cat(qkv),
                out=matrix([p + "attn.proj.weight"]), out_bias=vec(p + "attn.proj.bias"), norm2=norm(p + "norm2"),
                fc1=matrix([p + up + ".weight"]), fc1_bias=vec(p + up + ".bias"),
                fc2=matrix([p + down + ".weight"]), fc2_bias=vec(p + down + ".bias"),
                gate=None if cfg.qwen3 else matrix([p + "mlp.gate_proj.weight"]),
                gate_bias=None if cfg.qwen3 else vec(p + "mlp.gate_proj.bias")))
        weights = VitWeights(source.patch_weight().to(device), vec("patch_embed.proj.bias"), None, layers, None)
        vit_cfg = VitConfig(cfg.hidden, cfg.depth, cfg.heads, cfg.patch, layer_norm_eps=cfg.eps,
                            act="gelu_tanh" if cfg.qwen3 else "silu", post_norm=False,
                            norm="layer" if cfg.qwen3 else "rms")
        self.vit = VisionTransformer(vit_cfg, weights, dtype)
        self.pos_table = vec("pos_embed.weight") if cfg.qwen3 else None
        mergers = ["merger."] + [f"deepstack_merger_list.{j}." for j in range(len(cfg.deepstack_layers))]
        names = ("norm", "linear_fc1", "linear_fc2") if cfg.qwen3 else ("ln_q", "mlp.0", "mlp.2")
        self.mergers = [(norm(m + names[0]), matrix([m + names[1] + ".weight"]), vec(m + names[1] + ".bias"),
                         matrix([m + names[2] + ".weight"]), vec(m + names[2] + ".bias")) for m in mergers]
        d = cfg.head_dim // 2
        self.inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d)
        self.device = device

    @torch.inference_mode()
    def forward(self, image: PreparedImage) -> torch.Tensor:
        """The merged features of one image: [num_tokens, out_hidden * (1 + len(deepstack_layers))] (float32)."""
        cfg = self.cfg
        _, gh, gw = image.grid
        rows, cols = (t.to(self.device) for t in merge_order(gh, gw, cfg.merge))
        freqs = torch.cat([rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq], dim=-1)
        cos = torch.cat([freqs.cos(), freqs.cos()], dim=-1)[:, None, :]
        sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1)[:, None, :]  # rotate-half's sign folded in

        def rotary(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return _rotate(q, cos, sin), _rotate(k, cos, sin)

        pos = self._learned_positions(gh, gw)[rows, cols] if self.pos_table is not None else None
        masks = None
        if cfg.window:
            window = self._window_mask(rows, cols)
            masks = [None if i in cfg.full_layers else window for i in range(cfg.depth)]
        x, kept = self.vit.forward(image.pixel_values.to(self.device)[None], rotary=rotary, pos_add=pos,
                                   layer_masks=masks, keep_layers=cfg.deepstack_layers)
        merged = self._merge(0, x[0], post=False)
        deep = [self._merge(j + 1, kept[j][0], post=True) for j in range(len(kept))]
        return torch.cat([merged, *deep], dim=-1) if deep else merged

    def _learned_positions(self, gh: int, gw: int) -> torch.Tensor:
        """Qwen3-VL's square position table resampled (bilinear, corners aligned) to a gh x gw grid."""
        table = self.pos_table
        assert table is not None
        side = int(math.isqrt(table.shape[0]))
        grid = table.view(side, side, -1).permute(2, 0, 1)[None]
        return F.interpolate(grid, size=(gh, gw), mode="bilinear", align_corners=True)[0].permute(1, 2, 0)

    def _window_mask(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Qwen2.5-VL's window attention as a mask: patches attend within their window of merged units."""
        span = self.cfg.window // self.cfg.merge // self.cfg.patch * self.cfg.merge  # window side in patches
        wid = (rows // span) * (int(cols.max()) // span + 1) + cols // span
        return wid[:, None] == wid[None, :]

    def _merge(self, index: int, x: torch.Tensor, post: bool) -> torch.Tensor:
        """Patch merger `index` (0: the main one; then DeepStack's): each 2x2 block's features concatenated, normed
        (before the concatenation, or after it for DeepStack's `post` mergers), then a GELU MLP."""
        norm, fc1, b1, fc2, b2 = self.mergers[index]
        wide = self.cfg.hidden * self.cfg.merge ** 2
        x = self.vit.norm(x.reshape(-1, wide) if post else x, norm).reshape(-1, wide)
        return self.vit.linear(F.gelu(self.vit.linear(x, fc1, b1)), fc2, b2)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the rotate-half layout of x [..., n, heads, d] by [n, 1, d] tables (`signed_sin`: sin
    with the first half negated, so the halves only swap)."""
    half = x.shape[-1] // 2
    return torch.addcmul(x * cos, torch.cat([x[..., half:], x[..., :half]], dim=-1), signed_sin)


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
    wa = 0 if qwen3 else int(key("n_wa_pattern", 0))  # every wa-th layer has full attention
    token_pixels = (patch * merge) ** 2
    return QwenVisionConfig(
        projector_type=QWEN3_PROJECTORS[0] if qwen3 else QWEN25_PROJECTORS[0],
        hidden=int(key("embedding_length")), heads=int(key("attention.head_count")), depth=depth,
        intermediate=int(key("feed_forward_length")), out_hidden=int(key("projection_dim")),
        patch=patch, merge=merge, eps=float(key("attention.layer_norm_epsilon", 1e-6)),
        window=int(key("window_size", 112)) if wa else 0,
        full_layers=tuple(i for i in range(depth) if (i + 1) % wa == 0) if wa else (),
        num_position_embeddings=1 if "v.position_embd.weight" in tensor_names else 0,
        deepstack_layers=tuple(i for i, f in enumerate(deep_flags) if f),
        image_mean=tuple(key("image_mean", OPENAI_CLIP_MEAN)), image_std=tuple(key("image_std", OPENAI_CLIP_STD)),
        min_pixels=int(meta.get("clip.vision.image_min_pixels") or MMPROJ_MIN_TOKENS * token_pixels),
        max_pixels=int(meta.get("clip.vision.image_max_pixels") or MMPROJ_MAX_TOKENS * token_pixels),
    )


class QwenVLFamily:
    """The Qwen2.5-VL / Qwen3-VL adapter (family.VisionFamily): preprocessing, `<|vision_start|>` + image pads +
    `<|vision_end|>` in the prompt, the tower, and each image's M-RoPE grid for the language model."""

    bidirectional_images = False  # causal throughout, as transformers' Qwen-VL

    def __init__(self, cfg: QwenVisionConfig, tower: QwenVisionTower, source: VisionSource):
        self.cfg, self.tower, self.source = cfg, tower, source
        self.projector_type = cfg.projector_type

    def preprocess(self, image: Image.Image) -> PreparedImage:
        """The image as transformers' Qwen2VLImageProcessor prepares it (`preprocess`)."""
        return preprocess(image, self.cfg)

    def prompt_tokens(self, prepared: PreparedImage, tokenizer: Any) -> tuple[list[int], int]:
        """`<|vision_start|>`, num_tokens `<|image_pad|>`, `<|vision_end|>`; the pads start at offset 1."""
        start, pad, end = (special_id(tokenizer, t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"))
        return [start, *[pad] * prepared.num_tokens, end], 1

    def encode(self, images: list[PreparedImage]) -> list[torch.Tensor]:
        """Each image's rows [num_tokens, lm_hidden], with Qwen3-VL's DeepStack features after them on the feature
        axis ([num_tokens, lm_hidden * (1 + len(deepstack_layers))])."""
        return [self.tower.forward(image) for image in images]

    def mrope_grid(self, prepared: PreparedImage) -> tuple[int, int, int]:
        """The image's (t, h, w) grid in language-model tokens, for its M-RoPE positions."""
        t, h, w = prepared.grid
        return t, h // self.cfg.merge, w // self.cfg.merge

    def settings_digest(self) -> bytes:
        """A digest of the preprocessing settings, the tower's shape and the projector files' identity."""
        return identity_digest(self.source, self.cfg)


@register(*QWEN25_PROJECTORS, *QWEN3_PROJECTORS)
def load_qwen_vl(source: VisionSource, lm_config: Any, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> QwenVLFamily:
    """The family for a Qwen2.5-VL / Qwen3-VL mmproj GGUF or HF folder (checked against the language model's
    width where `lm_config` is given)."""
    if source.gguf is not None:
        cfg = config_from_gguf(source.gguf.metadata, source.gguf.tensor_names())
        weights = QwenSource(cfg, gguf=source.gguf)
    else:
        assert source.config is not None
        cfg = config_from_hf(source.config, source.preprocessor)
        weights = QwenSource(cfg, weights=source.weights)
    hidden = getattr(lm_config, "hidden_size", None)
    if hidden is not None and hidden != cfg.out_hidden:
        raise ModelLoadError(f"{source.path}: the vision projector makes {cfg.out_hidden}-wide rows but the language "
                             f"model is {hidden} wide (a projector of another model?)")
    return QwenVLFamily(cfg, QwenVisionTower(cfg, weights, dtype, device), source)
