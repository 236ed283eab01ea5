"""LFM3 (Liquid AI; HF `lfm3`, LFM3-1.7B): LFM2's gated short-convolution layers (7-wide conv cache) beside
sliding-window (256) and global GQA attention layers with per-head Q/K RMSNorm, RoPE (base 10,000 on the sliding
layers; proportional partial RoPE, base 1,000,000, on the global ones) and a sigmoid output gate per head
(`self_attn.gate_proj`, from the layer's normed input); sandwich norms (`post_operator_norm`, `post_ffn_norm`) around
each mixer and SwiGLU feed-forward. A conv layer keeps a conv state in the engine's state pool
(engine.cache.state_pool.short_conv_kind), a sliding layer its window of K/V, a global layer all of it.

GGUF: llama.cpp 0.3.36 has no `lfm3`. Ours (pending llama.cpp support) extends its `lfm2` naming: `lfm2`'s keys under
`lfm3.*` (per-layer `attention.head_count_kv`, 0 on conv layers; `shortconv.l_cache`), plus Gemma 4's spelling of
the rest: `attention.sliding_window`, `attention.sliding_window_pattern` (per layer), `rope.freq_base_swa`, and the
global layers' proportional RoPE as `rope_freqs.weight` (1 on rotated frequency pairs, 1e30 on the others); tensors
as `lfm2`'s, with `blk.N.attn_gate.weight` (llama.cpp's name of Step 3.5's per-head gate), and the sandwich norms as
`blk.N.post_attention_norm.weight` / `blk.N.post_ffw_norm.weight` (Gemma's)."""

from edgeserve.models.archs.lfm2 import GGUF_LAYER as _LFM2_LAYER
from edgeserve.models.archs.lfm2 import GGUF_TOP

# random weights (--load-format dummy): model.dummy_shapes

# our names of LFM3's tensors in a GGUF, by HF name: LFM2's for the norms, the short convolution and the SwiGLU
# feed-forward (q / k / v / o projections and Q/K norms keep Llama's; no Q/K permutation: LFM3 is a NeoX-RoPE model),
# plus the sandwich norms and the per-head gate
GGUF_LAYER = {
    **{hf: ours for hf, ours in _LFM2_LAYER.items()
       if hf.startswith(("operator_norm.", "ffn_norm.", "conv.", "feed_forward.w"))},
    "post_operator_norm.weight": "post_attention_norm.weight",
    "post_ffn_norm.weight": "post_ffw_norm.weight",
    "self_attn.gate_proj.weight": "attn_gate.weight",  # as the checkpoints store it (transformers: `g_proj`)
    "self_attn.g_proj.weight": "attn_gate.weight",
}
