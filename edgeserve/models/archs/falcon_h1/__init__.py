"""Falcon-H1 (TII; llama.cpp `falcon-h1`, HF `falcon_h1`): in every layer GQA attention with RoPE and a Mamba-2 mixer
side by side on the same normed input, their outputs summed into the residual, then a SwiGLU MLP. Each layer keeps
its KV in the paged pool and a conv and an SSM state per sequence in the engine's state pool
(engine.cache.state_pool.mamba2_kind; the Mamba-2 pieces are archs.nemotron_h's). Falcon-H1's multipliers are folded into
the weights as llama.cpp's converter does (an HF checkpoint's at load: model.FoldedScales)."""

from edgeserve.models.archs.nemotron_h import mamba2_gguf_names

# random weights (--load-format dummy): model.dummy_shapes

# llama.cpp's names of the tensors beyond Llama's, by HF name (no Q/K permutation: llama.cpp runs
# Falcon-H1's RoPE NeoX-style)
GGUF_TOP = {
    "model.final_layernorm.weight": "output_norm.weight",
}
GGUF_LAYER = {
    "pre_ff_layernorm.weight": "ffn_norm",  # without ".weight": as llama.cpp's converter names it
    "feed_forward.gate_proj.weight": "ffn_gate.weight",
    "feed_forward.up_proj.weight": "ffn_up.weight",
    "feed_forward.down_proj.weight": "ffn_down.weight",
    **mamba2_gguf_names("mamba."),
}
