"""Model definitions (Llama family) built from a ModelConfig and loaded weights."""
