"""Gemma 4 12B (HF `gemma4_unified`, class Gemma4UnifiedForConditionalGeneration): Gemma 4's text block without
per-layer inputs or experts (global layers with K = V and their own head size, the last layers reading an earlier
layer's K/V with a double-wide MLP), so it runs on archs/gemma4's decoder and native plan; config.py reads its HF
config's own defaults (transformers' defaults, which are not the released 12B's: that one has 48 layers of 3,840,
every sixth global with one K/V head of 512 and V = K, no KV-shared layers: benchmarks/make_gguf.py --shape
gemma4-12b, docs/MODELS.md). llama.cpp's converter writes it as a `gemma4` GGUF, which archs/gemma4 reads as it is.

Its images are encoder-free (merged pixel patches through one projection: edgeserve/vision/gemma4_unified.py, the
`gemma4uv` mmproj), an image's tokens attending both ways on the sliding layers as the larger Gemma 4 sizes'."""

# random weights (--load-format dummy): model.dummy_shapes (Gemma 4's)
