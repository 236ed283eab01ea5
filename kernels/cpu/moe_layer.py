"""A Mixture-of-Experts feed-forward as one native call (kernels/cpu/src/moe_layer.c): router, routing, the grouped
expert matmuls, the weighted slot sum and the shared expert.

`NativeMoE.build(layer)` packs an edgeserve.models.moe.MoELayer whose experts are GGUF blocks on the native kernels
into moe_layer.h's moe_t (its ctypes mirror: kernels.cpu.blocks.MoE) once; the per-op path (`MoELayer.forward` /
`mix` on the CPU) and the fused layer stack (kernels.cpu.decoder, through layer_t.moe) both run that struct, so the
two are one implementation.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field

import torch

from edgeserve.kernels.cpu import native as cpu_native
from edgeserve.kernels.cpu.blocks import EXPERT_PARTS, Experts, MoE
from edgeserve.kernels.cpu.native import BlockWeight, kept_f32_ptr
from edgeserve.kernels.formats.experts import BlockExperts

ROUTES = {"softmax_topk": 0, "topk_softmax": 1, "sigmoid_bias": 2}  # moe_layer.h's ROUTE_*
ACT_SILU, ACT_GELU_TANH, ACT_SWIGLU_OAI, ACT_RELU2 = 0, 1, 2, 3


def _experts(parts: list[tuple[int, int, int, int, int]]) -> Experts | None:
    """experts_t of (format id, address, bytes per expert, bytes per row, rows) parts; None past EXPERT_PARTS."""
    if len(parts) > EXPERT_PARTS:
        return None
    out = Experts()
    out.n_parts = len(parts)
    for i, (fmt, ptr, expert_bytes, row_bytes, rows) in enumerate(parts):
        out.fmt[i], out.w[i], out.expert_bytes[i] = fmt, ptr, expert_bytes
        out.row_bytes[i], out.rows[i] = row_bytes, rows
    return out


def _dense(weight) -> Experts | None:
    """A BlockWeight as a one-expert experts_t (the shared expert), or None when it is not one."""
    if not isinstance(weight, BlockWeight):
        return None
    return _experts([(fmt, ptr, 0, row_bytes, rows) for fmt, ptr, row_bytes, rows in weight.kernel_parts()])


def activation_code(spec, gated: bool = True) -> tuple[int, float, float] | None:
    """(moe_layer.c's ACT_*, alpha, limit) of a MoEConfig activation (`gated`: its experts have gate rows), or None
    for one the C side lacks: ungated experts take "relu2" alone, gated ones every other."""
    if (spec == "relu2") != (not gated):
        return None
    if spec == "relu2":
        return ACT_RELU2, 0.0, 0.0
    if spec == "silu":
        return ACT_SILU, 0.0, 0.0
    if spec == "gelu_tanh":
        return ACT_GELU_TANH, 0.0, 0.0
    from edgeserve.kernels.dispatch import swiglu_oai

    if isinstance(spec, functools.partial) and spec.func is swiglu_oai and not spec.args:
        kw = spec.keywords
        return ACT_SWIGLU_OAI, float(kw.get("alpha", 1.702)), float(kw.get("limit", 7.0))
    return None


def _on_cpu(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or t.device.type == "cpu" for t in tensors)


@dataclass
class NativeMoE:
    """A MoELayer packed for qmm_moe_forward; keeps alive every tensor the struct points into."""

    lib: ctypes.CDLL = field(repr=False)
    struct: MoE = field(repr=False)
    keep: list[torch.Tensor] = field(repr=False)
    hidden: int
    k: int
    has_shared: bool  # the layer's shared expert runs inside the call (else the caller adds it)

    @classmethod
    def build(cls, layer) -> "NativeMoE | None":
        """The plan of a MoELayer, or None where it does not fit moe_layer.c: experts not BlockExperts on the
        native kernels, weights off the CPU, an activation the C side lacks, sizes not multiples of 32. A shared
        expert that does not fit (dense weights) stays outside (`has_shared` False)."""
        lib = cpu_native.library()
        cfg = layer.config
        if lib is None or getattr(layer, "experts_on_host", False):
            return None
        if not (isinstance(layer.gate_up, BlockExperts) and isinstance(layer.down, BlockExperts)):
            return None
        act = activation_code(cfg.activation, cfg.gated)
        hidden, f = layer.router.shape[1], cfg.intermediate_size
        if act is None or hidden % 32 or f % 32 or cfg.router not in ROUTES:
            return None
        if not _on_cpu(layer.router, layer.router_bias, layer.choice_bias, layer.gate_up_bias, layer.down_bias):
            return None
        gate_up, down = _experts(layer.gate_up._kernel), _experts(layer.down._kernel)
        if gate_up is None or down is None:
            return None
        keep: list[torch.Tensor] = []
        ptr = functools.partial(kept_f32_ptr, keep)
        s = MoE()
        s.n_experts, s.k, s.hidden, s.F = cfg.num_experts, cfg.experts_per_token, hidden, f
        s.route, s.normalize = ROUTES[cfg.router], int(cfg.normalize_topk)
        s.scale, s.norm_eps, s.choice_bias = cfg.scale, cfg.norm_eps, ptr(layer.choice_bias)
        s.act, s.alpha, s.limit = act
        s.router, s.router_bias = ptr(layer.router), ptr(layer.router_bias)
        s.gate_up, s.down = gate_up, down
        s.gate_up_bias, s.down_bias = ptr(layer.gate_up_bias), ptr(layer.down_bias)
        has_shared = cls._pack_shared(layer.shared, s, act, ptr)
        return cls(lib, s, keep, hidden, cfg.experts_per_token, has_shared)

    @staticmethod
    def _pack_shared(shared, s: MoE, act: tuple[int, float, float], ptr) -> bool:
        """Fill `s`'s shared expert from a SharedExpert when it fits (block weights, the experts' activation);
        whether it did."""
        gated = act[0] != ACT_RELU2  # the shared expert is gated as the routed ones are
        if shared is None or activation_code(shared.activation, gated) != act or not _on_cpu(shared.gate):
            return False
        gate_up, down = _dense(shared.gate_up), _dense(shared.down)
        if gate_up is None or down is None:
            return False
        width = shared.down.in_features
        if width % 32 or shared.gate_up.out_features != (2 if gated else 1) * width \
                or shared.down.out_features != s.hidden:
            return False
        s.shared_F, s.shared_gate_up, s.shared_down = width, gate_up, down
        s.shared_gate = ptr(None if shared.gate is None else shared.gate.reshape(-1))
        return True

    def __del__(self) -> None:
        # the model's MoE layers are going away: give back moe_layer.c's kept scratch (the next call maps it again)
        if getattr(self, "lib", None) is not None:
            self.lib.qmm_moe_release()

    def address(self) -> int:
        """The moe_t's address (layer_t.moe of the fused stack)."""
        return ctypes.addressof(self.struct)

    def runs(self, h: torch.Tensor) -> bool:
        """Whether `h` is rows this call takes: CPU float32 / bfloat16 [T, hidden] with unit-stride rows."""
        return (h.device.type == "cpu" and h.dtype in (torch.float32, torch.bfloat16) and h.dim() == 2
                and h.shape[1] == self.hidden and (h.shape[0] == 0 or h.stride(1) == 1))

    def forward(self, h: torch.Tensor, weights: torch.Tensor | None = None, experts: torch.Tensor | None = None,
                shared: bool = True) -> torch.Tensor:
        """float32 [T, hidden]: the layer's output for the normed rows h [T, hidden] (`runs(h)`), routed by its
        router or by `weights` / `experts` [T, k] when given; the shared expert (where `has_shared`) with
        `shared`."""
        t = h.shape[0]
        out = torch.empty(t, self.hidden, dtype=torch.float32)
        if t == 0:
            return out
        w_ptr = ids_ptr = None
        if weights is not None and experts is not None:
            weights = weights.to(torch.float32).contiguous()
            experts = experts.to(torch.int32).contiguous()
            if tuple(weights.shape) != (t, self.k) or tuple(experts.shape) != (t, self.k):
                raise ValueError(f"routing must be [{t}, {self.k}], not {tuple(weights.shape)} / "
                                 f"{tuple(experts.shape)}")
            w_ptr, ids_ptr = weights.data_ptr(), experts.data_ptr()
        rc = self.lib.qmm_moe_forward(ctypes.byref(self.struct), t, h.data_ptr(), h.dtype == torch.bfloat16,
                                      h.stride(0), w_ptr, ids_ptr, int(shared and self.has_shared), out.data_ptr())
        if rc == -1:
            raise MemoryError(f"the MoE layer of {t} rows could not allocate its scratch memory")
        if rc != 0:
            raise ValueError("the MoE layer's routing names an expert it does not have")
        return out
