"""Quantize-on-load: a float (F32/F16/BF16) model's layer matrices become group-wise INT4 `Q4Blocks` as they are
read, so the same packing as GGUF 4-bit weights follows (torch's int4 matmul on CPU, W4A16 on the GPU) and the
full-precision matrices never all sit in memory at once.

Activation-aware scaling (AWQ-style, optional): a weight column that meets large activations matters more, so
before quantizing, column j of a matrix is multiplied by s_j and its input divided by s_j, which leaves the float
product unchanged but gives the important columns more of the 4-bit grid. s = mean|x|^alpha over a calibration
text, alpha picked per matrix from a small grid by the output error on those activations (`awq_search`). The
division of the input is folded into the weight that produces it, so nothing changes at run time:
- q/k/v (input: input_layernorm's output): input_layernorm.weight / s;
- gate/up (input: post_attention_layernorm's output): post_attention_layernorm.weight / s;
- down (input: silu(gate) * up): the rows of up_proj / s (a row scale of `up` scales the product).
o_proj is left unscaled (its input comes from attention over V heads shared by several query heads).
"""

from __future__ import annotations

import re

import torch

from edgeserve.kernels.formats.quant_linear import Q4Blocks

from .quantize_options import DEFAULT_GROUP_SIZE, GROUP_SIZES, QUANTIZE_METHODS, check_quantize_options  # noqa: F401
from .weights import WeightSource, WeightValue

_MATRIX_RE = re.compile(r"model\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.weight")


def group_for(in_features: int, group_size: int) -> int | None:
    """`group_size`, or the largest smaller allowed size dividing `in_features` (e.g. 64 for 576), or None."""
    for g in GROUP_SIZES[::-1]:
        if g <= group_size and in_features % g == 0:
            return g
    return None


def layer_matrix(name: str) -> tuple[int, str] | None:
    """(layer index, "self_attn.q_proj" ...) for a decoder layer's projection weight, else None."""
    m = _MATRIX_RE.fullmatch(name)
    return (int(m.group(1)), m.group(2)) if m else None


def awq_search(x: torch.Tensor, w: torch.Tensor, group_size: int, n_grid: int = 10) -> torch.Tensor:
    """Per-input-channel scale s [in] for weight w [out, in] given calibration inputs x [n, in].

    Tries s = mean|x|^alpha (normalized to a geometric mean of 1) for alpha = 0, 1/n_grid, ..., (n_grid-1)/n_grid
    and keeps the one whose int4-quantized (w * s) applied to x / s is closest to x @ w.T. alpha = 0 is plain
    round-to-nearest, so on the calibration data the result is never worse than no scaling.
    """
    x, w = x.float(), w.float()
    g = group_for(w.shape[1], group_size)
    if g is None:
        return torch.ones(w.shape[1])
    x_mean = x.abs().mean(0).clamp_min(1e-6)
    ref = x @ w.t()
    best, best_s = float("inf"), torch.ones_like(x_mean)
    for i in range(n_grid):
        s = x_mean.pow(i / n_grid)
        s = s / (s.max() * s.min()).sqrt()
        wq = Q4Blocks.quantize(w * s, g).dequantize() / s
        err = (x @ wq.t() - ref).pow(2).mean().item()
        if err < best:
            best, best_s = err, s
    return best_s


class Int4QuantizingWeights:
    """A WeightSource that hands out a float source's decoder-layer matrices as group-wise INT4 Q4Blocks.

    Embeddings, norms and the output head pass through unchanged (the head is the most sensitive matrix; on CPU it
    becomes per-row int8 anyway). `scales` (from `edgeserve.models.calibrate.awq_scales`): per layer
    {"attn", "mlp", "down"} input-channel scales, folded in as the module docstring says.
    """

    def __init__(self, base: WeightSource, group_size: int = DEFAULT_GROUP_SIZE,
                 scales: dict[int, dict[str, torch.Tensor]] | None = None):
        check_quantize_options("int4", group_size)
        self.base = base
        self.group_size = group_size
        self.scales = scales or {}
        self.kept_dense: list[str] = []  # matrices whose in_features no allowed group size divides

    def has(self, name: str) -> bool:
        return self.base.has(name)

    def get(self, name: str, keep_int4: bool) -> WeightValue:
        value = self.base.get(name, keep_int4)
        if not isinstance(value, torch.Tensor):
            return value  # already quantized
        value = self._fold_scales(name, value)
        if keep_int4 and layer_matrix(name) is not None:
            g = group_for(value.shape[1], self.group_size)
            if g is not None:
                return Q4Blocks.quantize(value, g)
            self.kept_dense.append(name)
        return value

    def _fold_scales(self, name: str, value: torch.Tensor) -> torch.Tensor:
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if not m or int(m.group(1)) not in self.scales:
            return value
        s = self.scales[int(m.group(1))]
        part = m.group(2)
        if part == "input_layernorm.weight":
            return value / s["attn"]
        if part == "post_attention_layernorm.weight":
            return value / s["mlp"]
        if part in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"):
            return value * s["attn"]
        if part == "mlp.gate_proj.weight":
            return value * s["mlp"]
        if part == "mlp.up_proj.weight":
            return value * s["mlp"] / s["down"].unsqueeze(1)
        if part == "mlp.down_proj.weight":
            return value * s["down"]
        return value
