"""A vision tower's blocks on the native CPU kernels, as the text encoders run theirs (models/bert.py): every layer
matrix a native weight (Bf16Weight for F16 / BF16 matrices, BlockWeight for quantized GGUF blocks; q, k and v one
fused matrix), the unmasked attention in the encoders' kernel (kernels/cpu/encoder_attention.py, head sizes any multiple
of 8), the MLP's bias and GELU in one native pass, torch's own few ops (LayerNorm, residual adds) on the calling
thread only, beside the native pool's threads.

Images (an Idefics3 image's tiles) go through the layers a group of about GROUP_TOKENS patches at a time, and the
large intermediates (fused q/k/v, attention output, the MLP's wide middle) are written into buffers kept for the
next forward, so an encode takes no fresh pages per layer or per image."""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from edgeserve.kernels.formats.bf16_weight import Bf16Weight, bf16_library
from edgeserve.kernels.cpu.native import BlockWeight, result_buffer
from edgeserve.kernels.cpu.encoder_attention import attention_library, encoder_attention
from edgeserve.kernels.cpu.encoder_gelu import bias_gelu_, gelu_library
from edgeserve.models.encoder_threads import intra_op_threads
from edgeserve.vision.stop import check as check_stop

ROWS_PER_CALL = 256  # activation rows a native matmul call (measured: 18-22% faster than 4,096 at once)
GROUP_TOKENS = 4096  # patches per group of images through the layers (Gemma 3's one image; 4 SmolVLM tiles)
_NATIVE_GELU = {"gelu_tanh": True, "gelu": False}  # the activations the native bias + GELU pass runs (tanh form?)


def is_native(w: Any) -> bool:
    """Whether a layer matrix runs on the native kernels' pool."""
    return isinstance(w, (Bf16Weight, BlockWeight))


def native_matrix(w: Any, device: torch.device) -> Any:
    """A dense bfloat16 CPU matrix as a Bf16Weight where this CPU runs the native bfloat16 kernel; else `w`."""
    if not isinstance(w, torch.Tensor) or w.dtype != torch.bfloat16 or w.dim() != 2 or device.type != "cpu":
        return w
    lib = bf16_library()
    return w if lib is None else Bf16Weight(w, lib)


def native_matmul(w: Any, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """x [M, in] @ w.T (+ bias) in float32 [M, out] for a native weight, into `out` where given; ROWS_PER_CALL rows
    a kernel call (their bfloat16 / 8-bit copy stays in cache for every weight panel, needs no fresh pages, and a
    decode step waiting for the native pool gets it between calls)."""
    m, n = x.shape[0], w.shape[0]
    y = result_buffer(out, m, n)
    for start in range(0, m, ROWS_PER_CALL):
        rows, part = x[start:start + ROWS_PER_CALL], y[start:start + ROWS_PER_CALL]
        if isinstance(w, Bf16Weight):
            w.matmul(rows, bias, out=part)
        else:
            w.matmul(rows, out=part)
            if bias is not None:
                part.add_(bias)
    return y


@dataclass
class NativeBlocks:
    """The native forward of a tower's blocks (LayerNorm, ungated MLP), built by `for_tower` where it runs."""

    num_heads: int
    eps: float
    act: str
    attn_lib: ctypes.CDLL
    gelu_lib: ctypes.CDLL | None
    _work: dict[str, torch.Tensor] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)  # one forward at a time over the buffers

    @staticmethod
    def for_tower(config: Any, layers: Sequence[Any]) -> "NativeBlocks | None":
        """The native blocks of a tower with `config` and `layers`, or None where some matrix is not native, the
        MLP is gated, the norm is not LayerNorm or the kernels do not take its head size."""
        if not layers or config.norm != "layer" or any(
                layer.gate is not None or not all(is_native(w) for w in (layer.qkv, layer.out, layer.fc1, layer.fc2))
                for layer in layers):
            return None
        attn = attention_library(config.head_dim)
        if attn is None:
            return None
        gelu = gelu_library() if config.act in _NATIVE_GELU else None
        return NativeBlocks(config.num_heads, config.layer_norm_eps, config.act, attn, gelu)

    def run(self, x: torch.Tensor, layers: Sequence[Any], keep_layers: Sequence[int],
            act: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The residual stream [B, N, hidden] after every block (updated in place), and after each layer in
        `keep_layers`, for the embedded patches `x` (unmasked attention within each image)."""
        b, n, _ = x.shape
        group = max(1, GROUP_TOKENS // n)
        done: list[torch.Tensor] = []
        kept: dict[int, list[torch.Tensor]] = {i: [] for i in sorted(set(keep_layers))}
        with self._lock, intra_op_threads(1):
            for start in range(0, b, group):
                xs = x[start:start + group].contiguous()
                for i, layer in enumerate(layers):
                    check_stop()  # the request went away: stop here, not after the last layer
                    self._block(xs, layer, act)
                    if i in kept:
                        kept[i].append(xs.clone())
                done.append(xs)
        out = done[0] if len(done) == 1 else torch.cat(done)
        return out, [parts[0] if len(parts) == 1 else torch.cat(parts) for parts in kept.values()]

    def _block(self, xs: torch.Tensor, layer: Any, act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """One pre-norm block over xs [G, N, hidden], in place."""
        g, n, d = xs.shape
        rows, m = xs.view(-1, d), g * n
        h = F.layer_norm(rows, (d,), layer.norm1[0], layer.norm1[1], self.eps)
        qkv = native_matmul(layer.qkv, h, layer.qkv_bias, self._buffer("qkv", m * 3 * d)).view(g, n, 3 * d)
        att = self._attention(qkv, g, n, d)
        rows.add_(native_matmul(layer.out, att.view(m, d), layer.out_bias))
        h = F.layer_norm(rows, (d,), layer.norm2[0], layer.norm2[1], self.eps)
        up = native_matmul(layer.fc1, h, None, self._buffer("up", m * layer.fc1.shape[0]))
        if self.gelu_lib is None or not bias_gelu_(up, layer.fc1_bias, self.gelu_lib, tanh=_NATIVE_GELU[self.act]):
            up = act(up if layer.fc1_bias is None else up.add_(layer.fc1_bias))
        rows.add_(native_matmul(layer.fc2, up, layer.fc2_bias))

    def _attention(self, qkv: torch.Tensor, g: int, n: int, d: int) -> torch.Tensor:
        """Each image's attention [G, N, hidden] from its fused q/k/v rows [G, N, 3 * hidden], one head a kernel call
        (a decode step waiting for the native pool gets it between heads, not after the whole layer's attention)."""
        att = self._buffer("att", g * n * d).view(-1)[:g * n * d].view(g, n, d)
        lengths = torch.full((g,), n, dtype=torch.int32)
        hd = d // self.num_heads
        for h in range(0, d, hd):
            done = encoder_attention(qkv[..., h:h + hd], qkv[..., d + h:d + h + hd], qkv[..., 2 * d + h:2 * d + h + hd],
                                     lengths, 1, self.attn_lib, att[..., h:h + hd])
            assert done is not None  # for_tower checked the head size; the views have the kernel's strides
        return att

    def _buffer(self, name: str, numel: int) -> torch.Tensor:
        """The kept float32 buffer `name` of at least `numel` values (grown when a larger group needs it)."""
        buf = self._work.get(name)
        if buf is None or buf.numel() < numel:
            buf = self._work[name] = torch.empty(numel, dtype=torch.float32)
        return buf
