"""Mixture-of-Experts layers in the fused native stack (kernels/cpu/src/layer.c through kernels.cpu.decoder): the
capability check.

A MoE layer enters the stack as a pointer to its moe_layer.c struct (layer_t.moe, kernels.cpu.moe_layer's
NativeMoE), which layer.c runs where a dense layer runs its MLP; the per-op path (models.moe.MoELayer on the CPU)
runs the same struct, so the two agree bit for bit. The attention beside it is the attention block with whatever
options the plan sets (sinks, an o_proj bias, sliding windows: kernels.cpu.decoder fills them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edgeserve.kernels.cpu.moe_layer import NativeMoE


def moe_plans(model) -> "list[NativeMoE | None] | None":
    """Each layer's MoE feed-forward as one native call (None for a layer with a dense MLP), or None when some
    MoE layer does not fit the stack: experts not in native block formats (or too many parts), an activation or
    router the C side lacks, a shared expert that would have to run outside the call, a hidden size other than
    the model's."""
    plans: list[NativeMoE | None] = []
    for layer in model.layers:
        moe = getattr(layer, "moe", None)
        if moe is None:
            plans.append(None)
            continue
        plan = moe.native()
        if plan is None or plan.hidden != model.config.hidden_size or (moe.shared is not None) != plan.has_shared:
            return None
        plans.append(plan)
    return plans
