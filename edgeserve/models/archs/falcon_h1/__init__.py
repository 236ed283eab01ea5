"""Falcon-H1 (TII; llama.cpp `falcon-h1`, HF `falcon_h1`): in every layer GQA attention with RoPE and a Mamba-2 mixer
side by side on the same normed input, their outputs summed into the residual, then a SwiGLU MLP. Each layer keeps
its KV in the paged pool and a conv and an SSM state per sequence in the engine's state pool
(engine.state_pool.mamba2_kind; the Mamba-2 pieces are archs.nemotron_h's). Falcon-H1's multipliers are folded into
the weights as llama.cpp's converter does (an HF checkpoint's at load: model.FoldedScales)."""

# random weights (--load-format dummy): model.dummy_shapes

# llama.cpp's names of the tensors beyond Llama's, by HF name (`mamba.ssm_a` is -exp(A_log); no Q/K permutation:
# llama.cpp runs Falcon-H1's RoPE NeoX-style)
GGUF_TOP = {
    "model.final_layernorm.weight": "output_norm.weight",
}
GGUF_LAYER = {
    "pre_ff_layernorm.weight": "ffn_norm",  # without ".weight": as llama.cpp's converter names it
    "feed_forward.gate_proj.weight": "ffn_gate.weight",
    "feed_forward.up_proj.weight": "ffn_up.weight",
    "feed_forward.down_proj.weight": "ffn_down.weight",
    "mamba.in_proj.weight": "ssm_in.weight",
    "mamba.conv1d.weight": "ssm_conv1d.weight",
    "mamba.conv1d.bias": "ssm_conv1d.bias",
    "mamba.dt_bias": "ssm_dt.bias",
    "mamba.ssm_a": "ssm_a",
    "mamba.D": "ssm_d",
    "mamba.norm.weight": "ssm_norm.weight",
    "mamba.out_proj.weight": "ssm_out.weight",
}
