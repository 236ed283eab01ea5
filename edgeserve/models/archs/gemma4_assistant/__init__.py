"""Gemma 4 assistant drafters (HF `gemma4_assistant` / `gemma4_unified_assistant`, GGUF `gemma4-assistant`): a small
Gemma 4 stack of q-only layers that attend over the target's K/V (its last sliding and last global layer's), fed
`pre_projection([target embedding(token) | target hidden])`, giving logits and `post_projection(hidden)` for the
next draft (config.py, model.py here; the proposer: edgeserve.engine.spec.assistant). It cannot run alone."""

# a drafter over a target's K/V, not a model to serve: --draft / --draft-model only
DRAFTER = True
# llama.cpp's names of its projections, sandwich norms and output scale, by HF name
GGUF_TOP = {
    "pre_projection.weight": "nextn.pre_projection.weight",
    "post_projection.weight": "nextn.post_projection.weight",
    "masked_embedding.centroids.weight": "masked_embd_centroids.weight",
    "masked_embedding.token_ordering": "masked_embd_ordering",
}
GGUF_LAYER = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "layer_scalar": "layer_output_scale.weight",
}
