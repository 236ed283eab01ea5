"""Gemma 4 (model.py, config.py here): sliding and global layers with their own head sizes, proportional RoPE,
per-layer embeddings, shared-KV layers, a per-layer output scale, and (26B-A4B) routed experts beside the MLP."""

# random weights: model.dummy_shapes (its names are not Llama's)
# llama.cpp's names of its sandwich norms, per-layer embeddings and output scale, by HF name
GGUF_TOP = {
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
}
GGUF_LAYER = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "per_layer_input_gate.weight": "inp_gate.weight",
    "per_layer_projection.weight": "proj.weight",
    "post_per_layer_input_norm.weight": "post_norm.weight",
    "layer_scalar": "layer_output_scale.weight",
    # the 26B-A4B MoE block: its router under the Qwen-MoE names edgeserve.models.moe_weights reads
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
}
