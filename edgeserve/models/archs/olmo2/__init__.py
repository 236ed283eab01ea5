"""OLMo 2 / OLMo 3 (model.py here): RMSNorm after attention and after the MLP only, Q/K RMSNorm over the
whole projection; OLMo 3's sliding-window layers (3 of every 4) with plain RoPE where the global ones scale it."""

# its norms after attention and after the MLP (it has none before them)
GGUF_LAYER = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
