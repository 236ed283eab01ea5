"""Gemma 2 and Gemma 3 (model.py here): GELU-tanh MLP, sandwich norms, scaled embeddings, sliding-window
layers in a fixed rhythm, soft-capping (Gemma 2), a local RoPE base (Gemma 3); EmbeddingGemma's GGUF
(`gemma-embedding`) is a Gemma 3 body."""
