"""Image input: decoding and limits (images.py), the one vision transformer (vit.py), and the per-family adapters
(family.py's registry: gemma3.py, idefics3.py, qwen_vl.py) that turn an image into language-model embedding rows."""
