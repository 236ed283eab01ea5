"""One place that picks a Triton kernel or its torch twin for each call.

Choice rules (per call, from the device of the call's main tensor):

1. `EDGESERVE_KERNELS=torch` (or `force_backend("torch")`): always the torch twins.
2. `EDGESERVE_KERNELS=triton` (or `force_backend("triton")`): Triton wherever it can run: CUDA tensors, and CPU
   tensors when `TRITON_INTERPRET=1` (the interpreter; this is how the tests run the kernels on CPU). A forced
   Triton call that cannot run (Triton missing, CPU tensors without the interpreter) raises instead of
   silently testing the twin.
3. Default (`auto`): on CPU, paged attention and the GGUF block-format matmuls run in the native C kernels
   (kernels.cpu.native) when they build (EDGESERVE_NATIVE=0 turns them off). Triton on a CUDA device with compute capability sm_75 through sm_90 (Turing, Ampere, Ada,
   Hopper) when Triton imports; the torch twins on CPU, on other devices (MPS, ROCm, newer or older CUDA
   parts, untested here), or when Triton is not installed.
4. A kernel whose shape the Triton version does not cover (e.g. a W4A16 weight whose in_features is not a
   multiple of 8, a head_dim above 256) takes its twin. (W8A16 weights always fit: `repack_q8` refuses others.)

The compute dtype (`compute_dtype`) is bfloat16 where the device has it (CPU, sm_80 and newer) and float16 on
sm_75, which has no bfloat16.

Every function here is a drop-in for the twin of the same name (same arguments, same result up to rounding):
`write_kv`, `paged_attention` (kernels.torch.paged_attention), `rms_norm`, `add_rms_norm` (kernels.torch.norm),
`rope_write_kv` (kernels.torch.rope), `silu_and_mul` (kernels.torch.activation), `linear` (kernels.formats.quant_linear, plus
`W4A16Weight` and `W8A16Weight`), `w4a16_matmul` (kernels.formats.w4a16), `w8a16_matmul` (kernels.formats.w8a16),
`causal_conv1d_silu`, `delta_gates`, `gated_delta_rule`, `gated_rms_norm` and `gated_delta_net` (kernels.torch.gated_delta),
`gated_short_conv` (kernels.torch.short_conv),
`head_rms_norm` (kernels.torch.norm over each head) and `sigmoid_gate` (kernels.torch.activation): native on CPU, the twins
elsewhere (no Triton version yet).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

from edgeserve.kernels.torch import activation as _act
from edgeserve.kernels.cpu import native as _native
from edgeserve.kernels.torch import gated_delta as _gdn
from edgeserve.kernels.torch import mamba2 as _m2
from edgeserve.kernels.torch import norm as _norm
from edgeserve.kernels.torch import paged_attention as _attn
from edgeserve.kernels.formats import quant_linear as _ql
from edgeserve.kernels.torch import rope as _rope
from edgeserve.kernels.torch import short_conv as _short_conv
from edgeserve.kernels.formats import w4a16 as _w4
from edgeserve.kernels.formats import w8a16 as _w8
from edgeserve.kernels.triton.runtime import HAS_TRITON, interpreting
from edgeserve.kernels.formats.kv_quant import is_fp8
from edgeserve.kernels.torch.paged_attention import AttentionMetadata
from edgeserve.kernels.formats.w4a16 import W4A16Weight, repack_q4
from edgeserve.kernels.formats.w8a16 import W8A16Weight, repack_q8

__all__ = [
    "AttentionMetadata", "W4A16Weight", "W8A16Weight", "repack_q4", "repack_q8", "backend", "compute_dtype",
    "force_backend", "use_triton", "triton_capable", "write_kv", "paged_attention", "rms_norm", "add_rms_norm",
    "rope_write_kv", "silu_and_mul", "gelu_tanh_and_mul", "swiglu_oai", "linear", "w4a16_matmul", "w8a16_matmul",
    "f32_row_linear", "causal_conv1d_silu", "gated_short_conv", "gated_delta_rule", "gated_rms_norm",
    "gated_delta_net", "delta_gates",
    "head_rms_norm",
    "sigmoid_gate",
]

BACKENDS = ("auto", "triton", "torch")
MIN_CAPABILITY = (7, 5)
MAX_CAPABILITY = (9, 0)
_forced: str | None = None


def backend() -> str:
    """The backend setting in force: `force_backend`'s, else EDGESERVE_KERNELS, else "auto"."""
    name = _forced or os.environ.get("EDGESERVE_KERNELS", "auto").strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"EDGESERVE_KERNELS must be one of {', '.join(BACKENDS)}, not {name!r}")
    return name


@contextlib.contextmanager
def force_backend(name: str) -> Iterator[None]:
    """Within the block, use this backend ("auto", "triton" or "torch") whatever the environment says."""
    global _forced
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {name!r}")
    previous, _forced = _forced, name
    try:
        yield
    finally:
        _forced = previous


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def triton_capable(device: torch.device | str) -> bool:
    """Whether the automatic choice runs Triton on this device (rule 3)."""
    device = torch.device(device)
    if not HAS_TRITON or device.type != "cuda" or torch.version.hip is not None:
        return False
    return MIN_CAPABILITY <= _capability(device) <= (MAX_CAPABILITY[0], 9)


def use_triton(device: torch.device | str) -> bool:
    """Whether a kernel call on tensors of this device takes the Triton path (rules 1-3)."""
    device = torch.device(device)
    name = backend()
    if name == "torch":
        return False
    if name == "triton":
        if not HAS_TRITON:
            raise RuntimeError("EDGESERVE_KERNELS=triton but Triton is not installed (pip install triton)")
        if device.type == "cpu" and not interpreting():
            raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 (the interpreter)")
        return True
    return triton_capable(device)


def compute_dtype(device: torch.device | str) -> torch.dtype:
    """bfloat16 where the device has it (CPU, CUDA sm_80+), float16 on older CUDA parts."""
    device = torch.device(device)
    if device.type == "cuda" and _capability(device) < (8, 0):
        return torch.float16
    return torch.bfloat16


def _native_cpu(x: torch.Tensor) -> bool:
    """Whether a call on this tensor takes the native CPU kernels (CPU tensor, `auto` backend, library loaded)."""
    return x.device.type == "cpu" and backend() == "auto" and _native.available()


# --- drop-in kernels ---------------------------------------------------------------------------------------

def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's k, v [T, Hkv, D] at their slots of one layer's pool (an indexed copy on every backend)."""
    _attn.write_kv(k_cache, v_cache, k, v, slot_mapping)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float | None = None, window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q [T, H, D] over each sequence's paged K/V; returns [T, H, D] in q's dtype.
    `window`: a sliding-window layer (the last `window` keys only); `softcap`: attention-logit soft-capping, which
    takes the torch twin on every device for now; `sinks`: float32 [H] attention sinks (gpt-oss). The tokens of one
    of `meta.attend_spans` see each other both ways (the Triton kernel is causal only: such steps take the twin)."""
    q8 = k_cache.dtype == torch.uint8  # a q8_0 pool (kernels.formats.kv_quant): the native kernels or the torch twin
    if (softcap is None and not q8 and meta.attend_spans is None and use_triton(q.device) and q.shape[-1] <= 256
            and q.shape[1] % k_cache.shape[2] == 0):
        from edgeserve.kernels.triton.paged_attention import paged_attention as kernel

        return kernel(q, k_cache, v_cache, meta, scale, window, sinks)
    if softcap is None and _native_cpu(q) and not is_fp8(k_cache):  # fp8: Triton or the torch twin
        # float32 C, batch-invariant
        done = _native.paged_attention(q, k_cache, v_cache, meta, scale, window=window, sinks=sinks)
        if done is not None:
            return done
    return _attn.paged_attention(q, k_cache, v_cache, meta, scale, window, softcap, sinks)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dimension, computed and returned in float32."""
    if use_triton(x.device) and x.shape[-1] <= 65536:
        from edgeserve.kernels.triton.norm import rms_norm as kernel

        return kernel(x, weight, eps)
    if _native_cpu(x):
        done = _native.add_rms_norm(x, None, weight, eps, torch.float32)
        if done is not None:
            return done[0]
    return _norm.rms_norm(x, weight, eps)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """tanh(x / cap) * cap (final logit soft-capping): one native pass on CPU (torch's threaded elementwise ops over
    a vocabulary of logits stall beside the native kernels' threads), torch elsewhere."""
    if _native_cpu(x):
        done = _native.softcap(x, cap)
        if done is not None:
            return done
    return torch.tanh(x / cap) * cap


def scaled_norm_add(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float, a: float, b: float,
                    c: float) -> torch.Tensor:
    """(rms_norm(x * a) * weight + y * b) * c over the last dimension of 2-D rows, in float32: natively on CPU
    (row by row, on the library's threads), the torch twin elsewhere."""
    if _native_cpu(x):
        done = _native.scaled_norm_add(x, y, weight, eps, a, b, c)
        if done is not None:
            return done
    return _norm.scaled_norm_add(x, y, weight, eps, a, b, c)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = residual + x (in residual's dtype); returns (rms_norm(new_residual) in out_dtype, new_residual)."""
    if use_triton(x.device) and x.shape[-1] <= 65536:
        from edgeserve.kernels.triton.norm import add_rms_norm as kernel

        return kernel(x, residual, weight, eps, out_dtype)
    if _native_cpu(x):
        done = _native.add_rms_norm(x, residual, weight, eps, out_dtype)
        if done is not None:
            return done
    return _norm.add_rms_norm(x, residual, weight, eps, out_dtype)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Rotate q and k by per-token cos/sin, store rotated k and v at their slots; returns rotated q in the cache dtype."""
    if k_cache.dtype != torch.uint8 and use_triton(q.device) and q.shape[-1] % 2 == 0:
        from edgeserve.kernels.triton.rope import rope_write_kv as kernel

        return kernel(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    if _native_cpu(q):
        done = _native.rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
        if done is not None:
            return done
    return _rope.rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


def rope_q(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
           dtype: torch.dtype) -> torch.Tensor:
    """Rotate q [T, H, D] alone (a KV-shared layer's, over `k_cache`'s pool): rotated q as rope_write_kv gives it
    for that pool, natively on CPU (the fused stack's kernel), else the torch twin in `dtype`."""
    if _native_cpu(q):
        none = q[:, :0]  # no K/V heads: nothing is written
        done = _native.rope_write_kv(q, none, none, cos, sin, k_cache, k_cache, torch.empty(0, dtype=torch.int64))
        if done is not None:
            return done
    return _rope.apply_rope(q, cos, sin).to(dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, where the last dimension is [gate | up]."""
    if use_triton(gate_up.device):
        from edgeserve.kernels.triton.activation import silu_and_mul as kernel

        return kernel(gate_up)
    if _native_cpu(gate_up):
        done = _native.silu_and_mul(gate_up)
        if done is not None:
            return done
    return _act.silu_and_mul(gate_up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up, where the last dimension is [gate | up] (Gemma's MLP)."""
    if _native_cpu(gate_up):
        done = _native.gelu_tanh_and_mul(gate_up)
        if done is not None:
            return done
    return _act.gelu_tanh_and_mul(gate_up)


def swiglu_oai(gate_up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU of rows [gate | up]: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g =
    min(gate, limit)."""
    if _native_cpu(gate_up):
        done = _native.swiglu_oai(gate_up, alpha, limit)
        if done is not None:
            return done
    return _act.swiglu_oai(gate_up, alpha, limit)


def f32_row_linear(x: torch.Tensor, w: torch.Tensor, tile: int = 16) -> torch.Tensor:
    """float32 x @ w.T for a small float32 weight w (a MoE router), each row's result independent of the other rows
    (routing must not change with the batch): the native kernel on CPU, matmuls of `tile` rows elsewhere."""
    if _native_cpu(x):
        done = _native.f32_matmul(x, w)
        if done is not None:
            return done
    return _ql.dense_tiles(x.float(), w, tile)


def w4a16_matmul(x: torch.Tensor, weight: W4A16Weight) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x's dtype for a packed 4-bit weight."""
    if use_triton(x.device):
        from edgeserve.kernels.triton.w4a16 import w4a16_matmul as kernel

        return kernel(x, weight)
    return _w4.w4a16_matmul(x, weight)


def w8a16_matmul(x: torch.Tensor, weight: W8A16Weight) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x's dtype for an 8-bit weight with group-wise scales."""
    if use_triton(x.device):
        from edgeserve.kernels.triton.w8a16 import w8a16_matmul as kernel

        return kernel(x, weight)
    return _w8.w8a16_matmul(x, weight)


def linear(x: torch.Tensor, weight: _ql.LinearWeight | W4A16Weight | W8A16Weight, bias: torch.Tensor | None = None,
           prompt_rows: _ql.PromptRows | None = None) -> torch.Tensor:
    """y = x @ W.T (+ b) for a dense, CPU-packed (Int4Weight / Int8Weight), W4A16 or W8A16 weight
    (`prompt_rows`: see kernels.formats.quant_linear.PromptRows)."""
    if isinstance(weight, (W4A16Weight, W8A16Weight)):
        y = w4a16_matmul(x, weight) if isinstance(weight, W4A16Weight) else w8a16_matmul(x, weight)
        return y + bias if bias is not None else y
    return _ql.linear(x, weight, bias, prompt_rows)


def causal_conv1d_silu(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                       batch: _gdn.DeltaBatch) -> torch.Tensor:
    """Gated DeltaNet's causal depthwise conv + SiLU over a ragged batch with per-slot conv states (float32)."""
    if _native_cpu(x):
        done = _native.gdn_conv(x, weight, conv_state, batch)
        if done is not None:
            return done
    return _gdn.causal_conv1d_silu(x, weight, conv_state, batch)


def gated_short_conv(bcx: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                     batch: _gdn.DeltaBatch) -> torch.Tensor:
    """A gated short convolution (LFM2's mixer): C * conv(B * x) for rows [B | C | x], over a ragged batch with
    per-slot conv states (float32 [T, C])."""
    if _native_cpu(bcx):
        done = _native.short_conv(bcx, weight, conv_state, batch)
        if done is not None:
            return done
    return _short_conv.gated_short_conv(bcx, weight, conv_state, batch)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, batch: _gdn.DeltaBatch, scale: float | None = None,
                     tiled: bool = False) -> torch.Tensor:
    """The gated delta rule over a ragged batch with per-slot recurrent states; o [T, Hv, Dv] float32."""
    if _native_cpu(q):
        done = _native.gdn_rule(q, k, v, g, beta, state, batch, scale, tiled)
        if done is not None:
            return done
    return _gdn.gated_delta_rule(q, k, v, g, beta, state, batch, scale, tiled)


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
             ssm_state: torch.Tensor, batch: _gdn.DeltaBatch) -> torch.Tensor:
    """The Mamba-2 (SSD) recurrence over a ragged batch with per-slot states; y [T, H, P] float32."""
    if _native_cpu(x):
        done = _native.ssd_rule(x, dt, A, B, C, D, ssm_state, batch)
        if done is not None:
            return done
    return _m2.ssd_scan(x, dt, A, B, C, D, ssm_state, batch)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(o) * weight * SiLU(z) over each head of o, z [T, H, D] (Qwen3.5's RMSNormGated), float32."""
    if _native_cpu(o):
        done = _native.head_rms_norm(o, weight, eps, z)
        if done is not None:
            return done
    return _gdn.gated_rms_norm(o, z, weight, eps)


def delta_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's gates (g, beta) [T, Hv] float32 from the projections a, b [T, Hv] (kernels.torch.gated_delta)."""
    if _native_cpu(a):
        done = _native.gdn_gates(a, b, A_log, dt_bias)
        if done is not None:
            return done
    return _gdn.delta_gates(a, b, A_log, dt_bias)


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head of x [T, H, D] (any strides: a view of a fused projection) times weight [D], float32
    [T, H, D]."""
    if _native_cpu(x):
        done = _native.head_rms_norm(x, weight, eps)
        if done is not None:
            return done
    return rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o * sigmoid(gate) for o, gate [T, H, D] (the gate any strides), float32 [T, H, D]."""
    if _native_cpu(o):
        done = _native.sigmoid_gate(o, gate)
        if done is not None:
            return done
    return _act.sigmoid_gate(o, gate)


def gated_delta_net(mixed_qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    weights: _gdn.DeltaNetWeights, dims: _gdn.DeltaNetDims, conv_state: torch.Tensor,
                    recurrent_state: torch.Tensor, batch: _gdn.DeltaBatch) -> torch.Tensor:
    """kernels.torch.gated_delta.gated_delta_net (the layer between its projections) with the kernels above."""
    return _gdn.gated_delta_net(mixed_qkv, z, a, b, weights, dims, conv_state, recurrent_state, batch,
                                conv=causal_conv1d_silu, rule=gated_delta_rule, norm=gated_rms_norm,
                                gates=delta_gates)
