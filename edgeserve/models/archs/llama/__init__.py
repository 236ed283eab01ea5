"""Llama and the variants that run its decoder with a few fields (issue 33): Mistral, SmolLM3 (no RoPE on every 4th
layer), Ministral 3 / Mistral Small 3.x (YaRN with its attention factor from `mscale` / `mscale_all_dim`, Llama 4's
attention temperature: queries times 1 + beta ln(1 + floor(pos / original))) and Granite 3.x dense (embedding,
residual, attention and logits multipliers)."""

PERMUTED_QK = True  # llama.cpp's converter permutes the Q/K rows for its interleaved RoPE
