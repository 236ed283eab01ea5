"""The decoder of the Qwen3.5 hybrids."""

from __future__ import annotations

from edgeserve.models.config import ModelConfig
from edgeserve.models.qwen35 import Qwen35Model


def model_class(config: ModelConfig) -> type[Qwen35Model]:
    """The hybrid decoder (its native plan: models.archs.qwen35.native_plan)."""
    return Qwen35Model


def dummy_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF names and shapes of a Qwen3.5 hybrid's tensors, for random weights (edgeserve.models.dummy): Gated
    DeltaNet layers (projections, conv, decay, gated norm), gated full attention (q_proj doubled for the gate, Q/K
    norms), a gated MLP or the experts with a shared expert."""
    from edgeserve.models.dummy import llama_shapes

    c, h, dims = config, config.hidden_size, config.delta
    assert dims is not None
    shapes = {n: s for n, s in llama_shapes(c).items() if ".self_attn." not in n}  # embeddings, norms, MLP / experts
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        if c.shared_expert_intermediate_size:
            s = c.shared_expert_intermediate_size
            shapes.update({p + "mlp.shared_expert.gate_proj.weight": (s, h), p + "mlp.shared_expert.up_proj.weight":
                           (s, h), p + "mlp.shared_expert.down_proj.weight": (h, s),
                           p + "mlp.shared_expert_gate.weight": (1, h)})
        if c.is_linear(i):
            a, nv = p + "linear_attn.", dims.num_v_heads
            shapes.update({a + "in_proj_qkv.weight": (dims.conv_dim, h), a + "in_proj_z.weight": (dims.value_dim, h),
                           a + "in_proj_b.weight": (nv, h), a + "in_proj_a.weight": (nv, h),
                           a + "conv1d.weight": (dims.conv_dim, 1, dims.conv_kernel), a + "A_log": (nv,),
                           a + "dt_bias": (nv,), a + "norm.weight": (dims.head_v_dim,),
                           a + "out_proj.weight": (h, dims.value_dim)})
        else:
            a = p + "self_attn."
            shapes.update({a + "q_proj.weight": (2 * c.q_size, h), a + "k_proj.weight": (c.kv_size, h),
                           a + "v_proj.weight": (c.kv_size, h), a + "o_proj.weight": (h, c.q_size),
                           a + "q_norm.weight": (c.head_dim,), a + "k_norm.weight": (c.head_dim,)})
    return shapes
