"""Weight and KV formats: how quantized and 16-bit tensors are laid out, packed and multiplied."""
