"""Phi-3 / Phi-4-mini (model.py here): the Llama decoder over fused weights, longrope RoPE scaling and
partial RoPE."""

LONGROPE = True  # HF rope_scaling type longrope / su
PARTIAL_ROTARY = True  # HF partial_rotary_factor below 1 (Phi-4-mini)
