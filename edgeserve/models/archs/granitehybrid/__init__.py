"""Granite 4 H (IBM; llama.cpp `granitehybrid`, HF `granitemoehybrid`): each layer a Mamba-2 mixer or GQA attention
without positional encoding, then a SwiGLU MLP (Tiny / Small: beside routed experts), with Granite's embedding /
residual / attention / logit multipliers. A Mamba-2 layer keeps no KV, a conv and an SSM state per sequence in the
engine's state pool (engine.cache.state_pool.mamba2_kind; the Mamba-2 pieces are archs.nemotron_h's)."""

from edgeserve.models.archs.nemotron_h import mamba2_gguf_names

EXPERTS = ("granitehybrid",)
# random weights (--load-format dummy): model.dummy_shapes

# llama.cpp's names of the tensors beyond Llama's, by HF name; the MLP's `input_linear` is [gate; up], which the
# converter splits (the model reads the halves under these names from a GGUF)
GGUF_LAYER = {
    **mamba2_gguf_names("mamba."),
    "shared_mlp.gate.weight": "ffn_gate.weight",
    "shared_mlp.up.weight": "ffn_up.weight",
    "shared_mlp.output_linear.weight": "ffn_down.weight",
}  # with experts the converter writes the MLP as the shared expert (ffn_*_shexp: the MoE layer's own names)
