"""Qwen2 (biases on q/k/v), Qwen3 (per-head Q/K RMSNorm), and the text models of Qwen2-VL / Qwen2.5-VL (Qwen2 with
M-RoPE in contiguous sections) and Qwen3-VL (Qwen3 with interleaved M-RoPE, which for text alone is 1-D RoPE; an
image's tokens take (t, h, w) positions, edgeserve.models.mrope; DeepStack adds visual features to the first layers'
hidden states at the image's rows): the Llama decoder with their fields."""
