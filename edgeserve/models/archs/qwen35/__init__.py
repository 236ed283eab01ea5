"""The Qwen3.5 hybrids, dense and MoE (edgeserve.models.qwen35, edgeserve.models.qwen35_config, which stay where they
are): Gated DeltaNet layers with a recurrent state beside gated full attention."""

EXPERTS = ("qwen35moe",)
# the Gated DeltaNet layers' tensors; `linear_attn.ssm_a` is llama.cpp's -exp(A_log) (edgeserve.models.qwen35 turns it
# back)
GGUF_LAYER = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.ssm_a": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
}
