"""Model loaders: GGUF, Hugging Face safetensors folders, tokenizers and chat templates."""
