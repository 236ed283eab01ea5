"""gpt-oss (model.py here): attention sinks and biases, alternating sliding / full layers, clamped
SwiGLU experts, YaRN with the ramp's ends not rounded."""

EXPERTS = True
YARN_UNTRUNCATED = True  # HF `truncate: false`, which its GGUF does not record
