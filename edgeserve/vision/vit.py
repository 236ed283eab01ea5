"""The one vision transformer every family's encoder runs: patch embedding, learned (or a family's rotary)
positions, pre-norm blocks (LayerNorm or RMSNorm, multi-head attention with qkv bias, GELU / quick-GELU MLP or a
gated SiLU MLP), optional per-layer hidden outputs. Families add their projector on top (gemma3.py, idefics3.py, qwen_vl.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from edgeserve.errors import ModelLoadError
from edgeserve.kernels.dispatch import linear as matmul
from edgeserve.kernels.formats.quant_linear import LinearWeight
from edgeserve.vision.native_vit import NativeBlocks, is_native, native_matmul
from edgeserve.vision.stop import check as check_stop


@dataclass
class VitConfig:
    """A vision transformer's shape."""

    hidden_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    act: str = "gelu_tanh"  # "gelu_tanh" (SigLIP), "gelu" (erf), "quick_gelu" (CLIP)
    post_norm: bool = True
    norm: str = "layer"  # "layer" (LayerNorm) or "rms" (RMSNorm, no bias: Qwen2.5-VL)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass
class VitLayer:
    """One pre-norm block's weights (matrices in any LinearWeight form: dense, or GGUF blocks on the CPU)."""

    norm1: tuple[torch.Tensor, torch.Tensor | None]  # weight, bias (None for RMSNorm)
    qkv: LinearWeight  # q, k, v stacked by rows
    qkv_bias: torch.Tensor | None
    out: LinearWeight
    out_bias: torch.Tensor | None
    norm2: tuple[torch.Tensor, torch.Tensor | None]
    fc1: LinearWeight  # the up projection where the MLP is gated
    fc1_bias: torch.Tensor | None
    fc2: LinearWeight
    fc2_bias: torch.Tensor | None
    gate: LinearWeight | None = None  # a gated MLP's gate: fc2(act(gate(h)) * fc1(h)) (Qwen2.5-VL)
    gate_bias: torch.Tensor | None = None


@dataclass
class VitWeights:
    """The tower's weights: the patch embedding as a matrix over flattened (C, p, p) patches."""

    patch: torch.Tensor  # [hidden, C * p * p]
    patch_bias: torch.Tensor | None
    pos_embed: torch.Tensor | None  # [positions, hidden] (learned); None where a family rotates instead
    layers: list[VitLayer]
    post_norm: tuple[torch.Tensor, torch.Tensor] | None


@dataclass(frozen=True)
class VitNames:
    """Where a source keeps the tower's tensors: `{i}` in the per-layer names is the layer index."""

    patch: str
    patch_bias: str
    pos_embed: str
    q: str
    k: str
    v: str
    out: str
    norm1: str
    norm2: str
    fc1: str
    fc2: str
    post_norm: str

    @staticmethod
    def hf_siglip(prefix: str) -> "VitNames":
        """transformers' SigLIP / Idefics3 vision tower under `prefix` (e.g. "model.vision_tower.")."""
        p, lp = prefix, prefix + "encoder.layers.{i}."
        return VitNames(p + "embeddings.patch_embedding.weight", p + "embeddings.patch_embedding.bias",
                        p + "embeddings.position_embedding.weight", lp + "self_attn.q_proj", lp + "self_attn.k_proj",
                        lp + "self_attn.v_proj", lp + "self_attn.out_proj", lp + "layer_norm1", lp + "layer_norm2",
                        lp + "mlp.fc1", lp + "mlp.fc2", p + "post_layernorm")


# llama.cpp's clip.cpp names (tools/mtmd/clip-impl.h) in an mmproj GGUF
GGUF_CLIP_NAMES = VitNames("v.patch_embd.weight", "v.patch_embd.bias", "v.position_embd.weight",
                           "v.blk.{i}.attn_q", "v.blk.{i}.attn_k", "v.blk.{i}.attn_v", "v.blk.{i}.attn_out",
                           "v.blk.{i}.ln1", "v.blk.{i}.ln2", "v.blk.{i}.ffn_up", "v.blk.{i}.ffn_down", "v.post_ln")

MatrixLoader = Callable[[list[str]], LinearWeight]


def load_vit_weights(source: Any, names: VitNames, config: VitConfig, matrix: MatrixLoader) -> VitWeights:
    """The tower's weights from a WeightSource (`has` / `get`), matrices through `matrix(names)` (rows stacked)."""
    def vec(name: str) -> torch.Tensor | None:
        return source.get(name, keep_int4=False).float() if source.has(name) else None

    def norm(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        w, b = vec(name + ".weight"), vec(name + ".bias")
        if w is None or b is None:
            raise ModelLoadError(f"vision tower: {name}.weight / .bias missing")
        return w, b

    def biases(*stems: str) -> torch.Tensor | None:
        found = [vec(s + ".bias") for s in stems]
        return None if any(b is None for b in found) else torch.cat(found)  # type: ignore[arg-type]

    if not source.has(names.patch):
        raise ModelLoadError(f"vision tower: {names.patch} missing")
    patch = source.get(names.patch, keep_int4=False).float()
    layers = []
    for i in range(config.num_layers):
        q, k, v, o, n1, n2, f1, f2 = (s.format(i=i) for s in (names.q, names.k, names.v, names.out, names.norm1,
                                                               names.norm2, names.fc1, names.fc2))
        layers.append(VitLayer(norm(n1), matrix([q + ".weight", k + ".weight", v + ".weight"]), biases(q, k, v),
                               matrix([o + ".weight"]), biases(o), norm(n2), matrix([f1 + ".weight"]), biases(f1),
                               matrix([f2 + ".weight"]), biases(f2)))
    post = norm(names.post_norm) if config.post_norm and source.has(names.post_norm + ".weight") else None
    return VitWeights(patch.reshape(patch.shape[0], -1), vec(names.patch_bias), vec(names.pos_embed), layers, post)


def patchify(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """Images [B, C, H, W] as their non-overlapping patches [B, (H/p) * (W/p), C * p * p], row-major, each patch
    flattened in (C, p, p) order (a stride-p convolution's weight [D, C, p, p] flattens to match)."""
    b, c, h, w = pixels.shape
    x = pixels.reshape(b, c, h // patch, patch, w // patch, patch)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // patch) * (w // patch), c * patch * patch)


_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "silu": F.silu,
}

# a family's rotary positions: (q, k [B, N, H, D]) -> rotated (q, k)
Rotary = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class VisionTransformer:
    """The encoder: patches in, hidden states out."""

    config: VitConfig
    weights: VitWeights
    dtype: torch.dtype = torch.float32
    native: bool = True  # the blocks on the native CPU kernels where they run (False: torch's ops, as a reference)
    _act: Callable[[torch.Tensor], torch.Tensor] = field(init=False)
    _native: NativeBlocks | None = field(init=False)

    def __post_init__(self) -> None:
        if self.config.act not in _ACTS:
            raise ModelLoadError(f"vision tower: activation {self.config.act!r} is not supported")
        self._act = _ACTS[self.config.act]
        self._native = NativeBlocks.for_tower(self.config, self.weights.layers)

    @property
    def runs_natively(self) -> bool:
        """Whether an unmasked forward runs its blocks on the native CPU kernels (vision/native_vit.py)."""
        return self.native and self._native is not None

    def linear(self, x: torch.Tensor, w: LinearWeight, b: torch.Tensor | None,
               keep_dtype: bool = False) -> torch.Tensor:
        """x [..., in] @ w.T + b in the compute dtype, as float32 [..., out] (`keep_dtype`: as the matmul gave it,
        for an intermediate the next matmul reads)."""
        shape = x.shape
        if is_native(w):  # float32 in and out; the kernel rounds to bfloat16 (or quantizes) itself
            y = native_matmul(w, x.reshape(-1, shape[-1]).float(), b)
            return y.reshape(*shape[:-1], y.shape[-1])
        if b is not None:  # into the matmul (one fused addmm for dense weights, not a float32 add after it)
            b = b.to(w.dtype if isinstance(w, torch.Tensor) else self.dtype)
        y = matmul(x.reshape(-1, shape[-1]).to(self.dtype), w, b)
        return (y if keep_dtype else y.float()).reshape(*shape[:-1], y.shape[-1])

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor, pos_ids: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None, rotary: Rotary | None = None,
                keep_layers: Sequence[int] = (), pos_add: torch.Tensor | None = None,
                layer_masks: Sequence[torch.Tensor | None] | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Hidden states [B, N, hidden] (after the post-norm, where the tower has one) for patches [B, N, C*p*p],
        and the residual stream after each layer in `keep_layers` (before the post-norm).

        `pos_ids` [N] picks the learned position rows (default 0..N-1); `attn_mask` [B or 1, 1, N, N] (bool: may
        attend) restricts attention (e.g. to each image of a packed sequence, or a window); `layer_masks` gives
        each layer its own mask instead (Qwen2.5-VL's window and full-attention layers); `rotary` rotates q and k
        instead of learned positions; `pos_add` [N, hidden] is added in place of the learned rows (a family's own
        position embedding, e.g. Qwen3-VL's table resampled to the image's grid)."""
        c, w = self.config, self.weights
        x = self.linear(patches.float(), w.patch, w.patch_bias)
        if pos_add is not None:
            x = x + pos_add
        elif w.pos_embed is not None:
            n = x.shape[1]
            if pos_ids is None and n > w.pos_embed.shape[0]:
                raise ValueError(f"{n} patches, but the tower has {w.pos_embed.shape[0]} positions")
            x = x + (w.pos_embed[:n] if pos_ids is None else w.pos_embed[pos_ids])
        if self.runs_natively and attn_mask is None and layer_masks is None and rotary is None:
            assert self._native is not None
            x, kept = self._native.run(x, w.layers, keep_layers, self._act)
            return (self.norm(x, w.post_norm) if w.post_norm is not None else x), kept
        kept: list[torch.Tensor] = []
        for i, layer in enumerate(w.layers):
            check_stop()  # the request went away: stop here, not after the last layer
            mask = layer_masks[i] if layer_masks is not None else attn_mask
            x = x + self._attention(self.norm(x, layer.norm1), layer, mask, rotary)
            x = x + self._mlp(self.norm(x, layer.norm2), layer)
            if i in keep_layers:
                kept.append(x)
        if w.post_norm is not None:
            x = self.norm(x, w.post_norm)
        return x, kept

    def norm(self, x: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        """The tower's LayerNorm (or RMSNorm) of x over its last axis."""
        c = self.config
        if c.norm == "rms":
            return F.rms_norm(x, (x.shape[-1],), weights[0], c.layer_norm_eps)
        return F.layer_norm(x, (x.shape[-1],), weights[0], weights[1], c.layer_norm_eps)

    def _mlp(self, h: torch.Tensor, layer: VitLayer) -> torch.Tensor:
        """The block's MLP: fc2(act(fc1 h)), or fc2(act(gate h) * fc1 h) where it is gated; the wide middle stays in
        the compute dtype (no float32 round trip of the largest activation)."""
        up = self.linear(h, layer.fc1, layer.fc1_bias, keep_dtype=True)
        if layer.gate is not None:
            up = self._act(self.linear(h, layer.gate, layer.gate_bias, keep_dtype=True)) * up
        else:
            up = self._act(up)
        return self.linear(up, layer.fc2, layer.fc2_bias)

    def _attention(self, h: torch.Tensor, layer: VitLayer, attn_mask: torch.Tensor | None,
                   rotary: Rotary | None) -> torch.Tensor:
        """Bidirectional multi-head self-attention of normed h [B, N, hidden]."""
        c = self.config
        b, n, _ = h.shape
        qkv = self.linear(h, layer.qkv, layer.qkv_bias).view(b, n, 3, c.num_heads, c.head_dim)
        q, k, v = qkv.unbind(2)
        if rotary is not None:
            q, k = rotary(q, k)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=attn_mask)
        return self.linear(o.transpose(1, 2).reshape(b, n, c.hidden_size), layer.out, layer.out_bias)
