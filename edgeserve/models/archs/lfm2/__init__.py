"""LFM2 / LFM2.5 (Liquid AI; llama.cpp `lfm2`, HF `lfm2`) and LFM2-MoE (`lfm2moe`, HF `lfm2_moe`): gated
short-convolution layers beside GQA attention layers with Q/K RMSNorm and RoPE, a SwiGLU feed-forward on every
layer (LFM2-MoE: after its leading dense layers, experts routed by a sigmoid, chosen with a per-expert bias). A conv
layer keeps no KV, only a conv state per sequence in the engine's state pool (engine.cache.state_pool.short_conv_kind)."""

EXPERTS = ("lfm2moe",)
# random weights (--load-format dummy): model.dummy_shapes

# llama.cpp's names of LFM2's tensors, by HF name (q / k / v projections keep Llama's; no Q/K permutation: LFM2 is
# a NeoX-RoPE model)
GGUF_TOP = {
    "model.embedding_norm.weight": "token_embd_norm.weight",  # the final norm, under llama.cpp's LFM2 name
}
GGUF_LAYER = {
    "operator_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "self_attn.out_proj.weight": "attn_output.weight",
    "self_attn.q_layernorm.weight": "attn_q_norm.weight",
    "self_attn.k_layernorm.weight": "attn_k_norm.weight",
    "conv.in_proj.weight": "shortconv.in_proj.weight",
    "conv.conv.weight": "shortconv.conv.weight",
    "conv.out_proj.weight": "shortconv.out_proj.weight",
    "feed_forward.w1.weight": "ffn_gate.weight",
    "feed_forward.w3.weight": "ffn_up.weight",
    "feed_forward.w2.weight": "ffn_down.weight",
    "feed_forward.expert_bias": "exp_probs_b.bias",  # LFM2-MoE: added to the router's sigmoids to choose experts
}
