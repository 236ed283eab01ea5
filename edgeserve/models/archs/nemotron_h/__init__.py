"""Nemotron-H (NVIDIA; llama.cpp `nemotron_h`, HF `nemotron_h`): a stack of single-mixer blocks, each
x = x + mixer(norm(x)), the mixer a Mamba-2 layer (M), GQA attention without positional encoding (*), or a
squared-ReLU MLP (-), or (`nemotron_h_moe`, Nemotron 3 Nano 30B-A3B) routed squared-ReLU experts beside a shared
one (E). A Mamba-2 layer keeps no KV, a conv and an SSM state per sequence in the engine's state pool
(engine.cache.state_pool.mamba2_kind); an MLP or MoE block keeps nothing."""

EXPERTS = ("nemotron_h_moe",)


def mamba2_gguf_names(prefix: str) -> dict[str, str]:
    """llama.cpp's names of a Mamba-2 mixer's tensors, by HF name under `prefix` (`mixer.` here, `mamba.` in Falcon-H1
    and Granite 4 H); `ssm_a` is llama.cpp's -exp(A_log) [H, 1], which the models turn back from HF's A_log."""
    names = {"in_proj.weight": "ssm_in.weight", "conv1d.weight": "ssm_conv1d.weight", "conv1d.bias": "ssm_conv1d.bias",
             "dt_bias": "ssm_dt.bias", "ssm_a": "ssm_a", "D": "ssm_d", "norm.weight": "ssm_norm.weight",
             "out_proj.weight": "ssm_out.weight"}
    return {prefix + hf: gguf for hf, gguf in names.items()}


# random weights (--load-format dummy): model.dummy_shapes

# llama.cpp's names of Nemotron-H's tensors, by the HF names the model reads (`model.` for the checkpoints'
# `backbone.`)
GGUF_TOP = {
    "model.embeddings.weight": "token_embd.weight",
    "model.norm_f.weight": "output_norm.weight",
}
GGUF_LAYER = {
    "norm.weight": "attn_norm.weight",
    **mamba2_gguf_names("mixer."),
    "mixer.q_proj.weight": "attn_q.weight",
    "mixer.k_proj.weight": "attn_k.weight",
    "mixer.v_proj.weight": "attn_v.weight",
    "mixer.o_proj.weight": "attn_output.weight",
    "mixer.up_proj.weight": "ffn_up.weight",
    "mixer.down_proj.weight": "ffn_down.weight",
    # MoE blocks: the router and experts read under the shared MoE loader's `mlp.*` names (its own table)
    "mixer.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mixer.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mixer.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
