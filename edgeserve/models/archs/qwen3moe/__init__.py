"""Qwen3-MoE: Qwen3's attention with a Mixture-of-Experts feed-forward (edgeserve.models.moe) routed by a softmax
over all experts, then the top k."""

EXPERTS = True
SOFTMAX_TOPK = True  # llama.cpp renormalizes the chosen weights without a GGUF key saying so
