"""The Mixture-of-Experts feed-forward layer shared by every MoE architecture: a router picks `experts_per_token`
of `num_experts` gated FFNs (or plain up / down ones: MoEConfig.gated) per token, their outputs are summed with the
router's weights, and an optional shared expert (a dense gated FFN, optionally sigmoid-gated) is added.

Expert weights stay as the file stores them (GGUF block formats on the native CPU kernels, kernels.formats.experts
BlockExperts; dense [E, rows, cols] tensors elsewhere, DenseExperts), and a step reads only its active experts,
each once for all the rows routed to it (kernels.formats.experts.ExpertGroups). A token's output does not depend on what
else is in the step: routing is per row, expert rows are computed on their own, and a token's expert outputs are
summed in its own slot order. On the CPU, with block-format experts, the whole layer is one native call
(kernels.cpu.moe_layer, kernels/cpu/src/moe_layer.c), the same one the fused native layer stack makes.

A layer whose experts stay in host memory (`experts_on_host`, --cpu-moe-layers, edgeserve.models.cpu_moe) routes
on the model's device, copies the routed rows to the host (pinned, non-blocking), runs the experts there on the
native kernels while the device computes the shared expert, and copies the routed sum back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from edgeserve.kernels.cpu.moe_layer import NativeMoE
from edgeserve.kernels.dispatch import backend, f32_row_linear, gelu_tanh_and_mul, linear, silu_and_mul
from edgeserve.kernels.formats.experts import EXPERT_TILE, ExpertGroups, Experts
from edgeserve.kernels.formats.quant_linear import LinearWeight, dense_tiles
from edgeserve.kernels.transfer import HostCopy, to_device

ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_bias")
# A gated activation: gate_up [N, 2F] (gate in the first half, up in the second) -> [N, F].
GatedActivation = Callable[[torch.Tensor], torch.Tensor]
_ACTIVATIONS: dict[str, GatedActivation] = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}


def relu_squared(up: torch.Tensor) -> torch.Tensor:
    """relu(up)^2 of a non-gated expert's up projection [N, F] (Nemotron-H's experts)."""
    return torch.relu(up).square()


_ACTIVATIONS["relu2"] = relu_squared  # non-gated: MoEConfig.gated False


def register_activation(name: str, fn: GatedActivation) -> None:
    """Make `fn` (gate_up [N, 2F] -> [N, F]) available to MoEConfig.activation under `name`."""
    _ACTIVATIONS[name] = fn


def gated_activation(spec: str | GatedActivation) -> GatedActivation:
    """The gated activation a config names (or the callable itself)."""
    if callable(spec):
        return spec
    try:
        return _ACTIVATIONS[spec]
    except KeyError:
        raise ValueError(f"unknown MoE activation {spec!r} (known: {', '.join(_ACTIVATIONS)})") from None


@dataclass(frozen=True)
class MoEConfig:
    """The shape and routing of a MoE layer.

    `router`: "softmax_topk" (softmax over all experts, then the top k; with `normalize_topk` the chosen weights
    are rescaled to sum to 1, as Qwen3 MoE's norm_topk_prob), "topk_softmax" (the top k logits, then a softmax
    over those k, as gpt-oss) or "sigmoid_bias" (the sigmoid of each logit; the top k of the sigmoids plus the
    layer's `choice_bias` chosen, weighed by their sigmoids, over their sum + `norm_eps` with `normalize_topk`:
    LFM2-MoE's, Nemotron-H's). Every route's weights end times `scale` (a routed scaling factor). `activation`: "silu", "gelu_tanh", a name given to `register_activation`, or a
    callable gate_up [N, 2F] -> [N, F]. Non-`gated` experts have an up projection alone ([E, F, hidden] in the
    `gate_up` slot) and an activation up [N, F] -> [N, F] ("relu2": Nemotron-H's)."""

    num_experts: int
    experts_per_token: int
    intermediate_size: int  # per expert
    router: str = "softmax_topk"
    normalize_topk: bool = False
    activation: str | GatedActivation = "silu"
    gated: bool = True
    scale: float = 1.0
    norm_eps: float = 0.0

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, not {self.router!r}")
        if not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token {self.experts_per_token} must be in 1..{self.num_experts}")


@dataclass
class SharedExpert:
    """A dense gated FFN every token goes through (or, with activation "relu2", an ungated one: Nemotron-H's), added
    to the routed output; with `gate` ([1, hidden] float32) its output is scaled by sigmoid(h @ gate.T) (Qwen2-MoE's
    shared_expert_gate)."""

    gate_up: LinearWeight  # [2S, hidden], gate rows first ([S, hidden] of up rows alone for "relu2")
    down: LinearWeight  # [hidden, S]
    gate: torch.Tensor | None = None
    activation: str | GatedActivation = "silu"

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """float32 [T, hidden] for the normed hidden states h [T, hidden]."""
        act = gated_activation(self.activation)
        y = row_linear(act(row_linear(h, self.gate_up)), self.down).float()
        if self.gate is not None:
            y = y * row_sigmoid(f32_row_linear(h, self.gate))
        return y


SIGMOID_PAD = 64  # elements: a multiple of every SIMD loop's step, so no value takes a loop's remainder path


def row_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """sigmoid of a [T, 1] column whose values do not depend on T: torch's vectorized loop computes the last
    (numel % its step) values on another path, whose results can differ by an ulp (seen on AVX-512), so the column
    is padded to a multiple of SIGMOID_PAD first."""
    t = x.shape[0]
    flat = torch.nn.functional.pad(x.reshape(-1), (0, -x.numel() % SIGMOID_PAD))
    return torch.sigmoid(flat)[:x.numel()].view(t, -1)


def row_linear(x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
    """x @ W.T with each row's result independent of the other rows (dense weights in fixed tiles; the native
    and packed kernels are row-independent already)."""
    if isinstance(weight, torch.Tensor):
        return dense_tiles(x.to(weight.dtype), weight, EXPERT_TILE)
    return linear(x, weight)


def ffn_input_dtype(layer: object, dtype: torch.dtype) -> torch.dtype:
    """The dtype of a decoder layer's normed feed-forward input: float32 where it is a MoE layer's (its router's
    input: a bf16-rounded row flips experts at near-ties; the experts quantize or round it themselves, so it costs
    nothing), else the compute dtype `dtype`."""
    return torch.float32 if getattr(layer, "moe", None) is not None else dtype


def route(logits: torch.Tensor, config: MoEConfig,
          choice_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert ids long [T, k]) for router logits [T, E], per MoEConfig.router (the torch
    twin of moe_layer.c's routes; `choice_bias` [E]: sigmoid_bias's); the experts come in order of falling weight
    (of falling sigmoid + bias for sigmoid_bias)."""
    k = config.experts_per_token
    logits = logits.float()
    if config.router == "topk_softmax":
        top, experts = torch.topk(logits, k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    elif config.router == "sigmoid_bias":
        probs = row_sigmoid(logits)
        experts = torch.topk(probs if choice_bias is None else probs + choice_bias, k, dim=-1).indices
        weights = probs.gather(1, experts)
        if config.normalize_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + config.norm_eps)
    else:
        weights, experts = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
        if config.normalize_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if config.scale == 1.0 else weights * config.scale), experts


class MoELayer:
    """A MoE feed-forward layer: `forward(h [T, hidden]) -> float32 [T, hidden]`.

    `router` [E, hidden] float32 (+ `router_bias` [E]); `gate_up` experts [E, 2F, hidden] (gate rows first; [E, F,
    hidden] of up rows alone where the config is not `gated`) and
    `down` experts [E, hidden, F], with optional biases `gate_up_bias` [E, 2F] and `down_bias` [E, hidden]
    (float32); `choice_bias` [E]: the sigmoid_bias router's (added to the sigmoids to choose the experts);
    `shared`: an optional SharedExpert."""

    def __init__(self, config: MoEConfig, router: torch.Tensor, gate_up: Experts, down: Experts,
                 router_bias: torch.Tensor | None = None, gate_up_bias: torch.Tensor | None = None,
                 down_bias: torch.Tensor | None = None, shared: SharedExpert | None = None,
                 choice_bias: torch.Tensor | None = None):
        e, f = config.num_experts, config.intermediate_size
        hidden = router.shape[1]
        if tuple(router.shape) != (e, hidden):
            raise ValueError(f"router is {tuple(router.shape)}, expected ({e}, hidden)")
        if gate_up.shape != (e, (2 if config.gated else 1) * f, hidden) or down.shape != (e, hidden, f):
            raise ValueError(f"expert shapes {gate_up.shape} / {down.shape} do not match {e} experts of "
                             f"{f} x {hidden}")
        self.config = config
        self.router = router.float()
        self.router_bias = None if router_bias is None else router_bias.float()
        self.choice_bias = None if choice_bias is None else choice_bias.float().reshape(-1)
        self.gate_up, self.down = gate_up, down
        self.gate_up_bias = None if gate_up_bias is None else gate_up_bias.float()
        self.down_bias = None if down_bias is None else down_bias.float()
        self.shared = shared
        self.activation = gated_activation(config.activation)
        # the experts (and their biases) are in host memory while h is on the model's device (--cpu-moe-layers)
        self.experts_on_host = False
        self._native: NativeMoE | None | bool = False  # the one-call native layer, planned on first use

    def native(self) -> NativeMoE | None:
        """The whole layer as one native call (kernels.cpu.moe_layer), planned once; None where it does not apply
        (experts not in native block formats, a GPU, host experts). Setting `_native = None` keeps the torch path
        around the grouped expert matmuls (tests compare the two that way)."""
        if self._native is False:
            self._native = NativeMoE.build(self)
        return self._native  # type: ignore[return-value]

    def _native_for(self, h: torch.Tensor) -> NativeMoE | None:
        native = self.native()
        return native if native is not None and native.runs(h) and backend() == "auto" else None

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights float32 [T, k], expert ids [T, k]) for h [T, hidden]; the logits are float32, each row on its
        own (the native kernel on CPU, fixed tiles elsewhere)."""
        logits = f32_row_linear(h, self.router)
        if self.router_bias is not None:
            logits = logits + self.router_bias
        return route(logits, self.config, self.choice_bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """float32 [T, hidden]: the routed experts' weighted sum (plus the shared expert) for normed h [T, hidden]."""
        t = h.shape[0]
        if t == 0:
            return torch.zeros(0, self.router.shape[1], dtype=torch.float32, device=h.device)
        native = self._native_for(h)
        if native is not None:  # router, experts, slot sum and shared expert in one call
            return self._with_shared(native, h, native.forward(h))
        weights, experts = self.route(h)
        return self.mix(h, weights, experts)

    def _with_shared(self, native: NativeMoE, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` plus the shared expert where the native call did not run it."""
        if self.shared is not None and not native.has_shared:
            out += self.shared.forward(h)
        return out

    def mix(self, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """float32 [T, hidden]: the experts `experts` [T, k] run on h [T, hidden], summed with `weights` [T, k]
        (plus the shared expert); `forward` after routing, for a model that routes its own way (Gemma 4)."""
        if self.experts_on_host:
            return self._mix_on_host(h, weights, experts)
        native = self._native_for(h)
        if native is not None:
            return self._with_shared(native, h, native.forward(h, weights, experts))
        out = self.routed(h, weights, experts)
        if self.shared is not None:
            out += self.shared.forward(h)
        return out

    def routed(self, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """float32 [T, hidden]: the routed experts' weighted sum alone, on the device of the expert weights."""
        t, k = h.shape[0], experts.shape[1]
        groups = ExpertGroups.build(experts, self.config.num_experts)
        gate_up = self.gate_up.grouped(h, groups, gather=True)
        if self.gate_up_bias is not None:
            gate_up += self.gate_up_bias[groups.expert]
        y = self.down.grouped(self.activation(gate_up), groups, gather=False)
        if self.down_bias is not None:
            y += self.down_bias[groups.expert]
        slots = y[groups.inverse].view(t, k, y.shape[1])  # back to (token, slot) order
        out = slots[:, 0] * weights[:, :1]
        for j in range(1, k):  # each token's experts summed in its own slot order
            out += slots[:, j] * weights[:, j:j + 1]
        return out

    def _mix_on_host(self, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """`mix` with the experts in host memory: the routed rows go to the host (non-blocking into pinned memory),
        the device computes the shared expert meanwhile, and the routed sum comes back to h's device."""
        copy = HostCopy.start(_RoutedRows(h, weights, experts))  # staged copies (CUDA), the tensors as they are else
        shared = self.shared.forward(h) if self.shared is not None else None  # queued on the device meanwhile
        rows = copy.wait()
        out = to_device(self.routed(rows.h, rows.weights, rows.experts), torch.float32, h.device)
        if shared is not None:
            out += shared
        return out


@dataclass
class _RoutedRows:
    """A step's normed hidden states and routing choice, on their way to the host experts."""

    h: torch.Tensor  # [T, hidden]
    weights: torch.Tensor  # float32 [T, k]
    experts: torch.Tensor  # [T, k] expert ids
